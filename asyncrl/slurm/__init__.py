"""`asyncrl slurm`: a run as a SLURM batch job (docs/slurm.md).

Place in the data flow: nothing new runs here. The batch script this package writes starts the
processes a multi-host run already has (docs/multi-host.md) inside one allocation: the launcher
on the first node, the learner's ranks as a torchrun job step on the learner nodes, and
`asyncrl worker --join` as a job step on the generator nodes. It turns SLURM's warning signal
into the launcher's graceful stop (a checkpoint) and requeues the job, which resumes from it.

  script.py   pure: the allocation's layout and the batch script's text
  submit.py   the command: checks, the run directory, keys, sbatch
  join.py     a helper the script runs: the launcher's control address, once it is there
"""
