"""The algorithm, eager and readable: typed hand-offs, the serial decoding loop, the row cache, the
eager engine, sampling, verification (chains and trees), the simple schedules and every metric.

Nothing here imports from `specdec.accel`, `specdec.adaptive`, `specdec.study` or `specdec.train`
(tests/test_walls.py reads the imports): this wing is the reference that the others accelerate,
steer and measure.
"""
