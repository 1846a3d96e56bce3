"""`asyncrl bench ...`: throughput benchmarks shipped with the package (scripts in bench/ call these).

Each module here defines one typer `command`; module import must stay cheap (heavy imports go
inside the functions) because `asyncrl --help` imports them all. Benchmarks assert nothing: they
measure variants side by side in one run and report medians and ratios.
"""
