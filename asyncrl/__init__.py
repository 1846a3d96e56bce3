"""asyncrl: Ray-free asynchronous RL post-training for language models.

Data flow (one machine by default; every socket on loopback):

    launcher (scheduler/service.py)  --PromptTasks------------------->  generator[i] (generators/service.py)
      | owns prompts, admission,       --WeightsPublished (forwarded)-->    | samples with the torch model,
      | supervision, metrics.jsonl   <--TasksDone, WeightsLoaded--------    | scores with the task's verifier
      |                                                                     |
      |  <--Hello(endpoint), StepDone, WeightsPublished--+                  | Trajectories: samples finished together,
      |  --WeightsLoaded (forwarded), Shutdown---------> |                  v  a Trajectory per sample (+ tensor
      |                                          learner (learner/service.py)    frames: ids, log-probs, versions;
      |                                                                          OPD caches; loss mask)
      |                                            PULL socket -> StepLoop (learner/loop.py) -> Trainer
      |                                            (learner/trainer.py): streams each trajectory's
      |                                            gradient, one update per step; ranks 1..R-1
      |                                            (learner/ranks.py) get their groups forwarded;
      |                                            publishes each version (transport/publisher.py:
      |                                            safetensors shards or a broadcast group; with
      |                                            generators.kind=sglang the SGLang servers are the
      |                                            group's ranks: generators/sglang/publisher.py)

| loop | consumes | produces | waits for | unblocked by |
|---|---|---|---|---|
| launcher dispatch | WeightsLoaded, Hello | PromptTasks, one per generator (re-queued tasks first) | a free admission credit | every serving generator loading a newer version (a dead one, or a replacement still loading, does not count) |
| generator work | PromptTasks, WeightsPublished, DataEndpoint | Trajectories (the samples that finished together) and TasksDone (the tasks they completed), WeightsLoaded | a pending task | PromptTasks |
| learner train | Trajectories (or a lone Trajectory) | StepDone, WeightsPublished (while the next step trains) | a trajectory of the current step (the whole window when the objective cannot stream) | the next Trajectory |
| learner ctrl | WeightsLoaded, Shutdown | deletions of unused versions | a control message | the launcher |
| teacher (opd.placement = "service") | TeacherRequest | TeacherScores | a request | a generator's batch |

Admission (scheduler/admission.py): group j is trained at step j // B and is admitted only
when every generator holds a version >= j // B - max_staleness, so no token is ever more than
max_staleness versions older than the step that trains on it.

Packages, layers (which may import which) and where a change goes: docs/architecture.md.
"""

__version__ = "0.1.0"
