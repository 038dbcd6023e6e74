"""Run orchestration on Kubernetes: a run file in, the Jobs of every stage out, their progress read back.

By role, each subpackage importing only from those listed after it (`__main__`, the command line, is on top):
- `drive/`: a submitted run: the run driver, its kube client and run state, `status`, `wait`, `logs`, `cancel`,
  `resume`, `restart`;
- `local/`: a run on this machine, every stage as a process with its Job's settings, and its console;
- `pilot/`: the pilot run derived from the full one, its report, and the full run's plan from its figures;
- `plan/`: `pipeline plan`: work, GPU-hours, cost, the GPU memory fit and a gang's hold, before any submit;
- `render/`: the Kubernetes objects: pods, scheduling, the stage Jobs and JobSets, the run driver's objects,
  the namespace setup and the kustomize bases;
- `staging/`: `stage-model`, a target model's folder into the object store;
- `run/`: what a run is: the run file (`RunConfig`), its prefixes, its stages and their wiring.

The command line is `python -m dflash_pipeline {render,submit,status,plan,local,cancel,drive,wait,...}`.
"""

from dflash_pipeline.render.jobs import (
    build_job,
    evaluate_job,
    export_job,
    generate_job,
    import_job,
    serve_check_job,
    tokenize_job,
    train_job,
)
from dflash_pipeline.render.run_objects import render_documents
from dflash_pipeline.run.config import RunConfig, load_run_config, parse_run_config
from dflash_pipeline.run.layout import RunLayout, layout

__all__ = [
    "RunConfig",
    "RunLayout",
    "build_job",
    "evaluate_job",
    "export_job",
    "generate_job",
    "import_job",
    "layout",
    "load_run_config",
    "parse_run_config",
    "render_documents",
    "serve_check_job",
    "tokenize_job",
    "train_job",
]
