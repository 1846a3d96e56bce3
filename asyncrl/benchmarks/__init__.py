"""`asyncrl bench ...`: every benchmark, shipped with the package (bench/README.md: where
benchmarks live, and the figures measured so far).

Each command module here defines one typer `command`, or an argparse `main(argv)` that
`asyncrl bench NAME` passes its arguments to (cli.py); a command module's import must stay cheap
(heavy imports go inside the functions) because `asyncrl --help` imports them all. Benchmarks assert nothing: they
measure variants side by side in one run and report medians and ratios.
"""
