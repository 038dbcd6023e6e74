"""Run orchestration on Kubernetes: a run file in, the Jobs of every stage out, their progress read back.

- `config`: `RunConfig`, one TOML/JSON file per run.
- `layout`: the prefixes of a run, <root>/<run_id>/<kind>.
- `stages`: what each stage is (image, command, config prefix) and how it is wired to the layout.
- `jobs`: the one Job builder every stage goes through, and the namespace and ServiceAccount.
- `driver_objects`, `run_objects`: the stage Jobs as templates, the run driver's objects, all a run applies.
- `driver`, `kube`, `run_state`: the run driver (creates each stage's Job once its input is committed) and
  the state it writes for `status`.
- `base`: the same objects written as a kustomize base (k8s/base).
- `status`, `wait`: progress read from storage; waiting for a manifest from a script.

The command line is `python -m dflash_pipeline {render,submit,status,plan,local,drive,wait}`.
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
