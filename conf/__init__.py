"""The Hydra configs of specdec (one YAML per option of each group; schema in specdec/study/config.py).

This folder is the configs' one home in the repository; packaging ships it inside the package as
`specdec.conf` (pyproject.toml maps the one onto the other), and `specdec-run` / `python -m specdec`
read it as `pkg://specdec.conf`, so a clone, an editable install and a wheel use the same files. This
file is what makes it a package: Hydra reads `pkg://` configs only from a package.
"""
