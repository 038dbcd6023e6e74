"""Run orchestration on Kubernetes: a run file in, the Jobs of every stage out, their progress read back.

- `config`: `RunConfig`, one TOML/JSON file per run.
- `layout`: the prefixes of a run, <root>/<run_id>/<kind>.
- `stages`: what each stage is (image, command, its package's config model) and how it is wired to the layout.
- `pods`: the pod every workload of a run is built from (security contexts, home, storage and credentials).
- `jobs`: the one Job builder every stage goes through; `jobset`: a multi-node gang as a JobSet, from the same
  pod template.
- `namespace_setup`: the namespace's one-time setup (Namespace, the stages' ServiceAccount), in no run.
- `driver_objects`, `run_objects`: the stage Jobs as templates, the run object, the run driver's objects, all
  a run applies.
- `driver`, `kube`, `run_state`: the run driver (creates each stage's Job once its input is committed) and
  the state it writes for `status`; `cancel`: delete one run's objects.
- `gang_hold`: how long a lost rank keeps a multi-node gang's other GPUs, from the rendered Job.
- `base`: the same objects written as a kustomize base (k8s/base), the setup as another (k8s/namespace).
- `status`, `wait`: progress read from storage; waiting for a manifest from a script.

The command line is `python -m dflash_pipeline {render,submit,status,plan,local,cancel,drive,wait}`.
"""

from dflash_pipeline.config import RunConfig, load_run_config, parse_run_config
from dflash_pipeline.jobs import (
    build_job,
    evaluate_job,
    export_job,
    generate_job,
    import_job,
    serve_check_job,
    tokenize_job,
    train_job,
)
from dflash_pipeline.layout import RunLayout, layout
from dflash_pipeline.run_objects import render_documents

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
