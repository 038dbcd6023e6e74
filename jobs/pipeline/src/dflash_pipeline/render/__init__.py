"""The Kubernetes objects of a run, from its `run` definition alone: the pod every workload is built from
(`pods`), what the scheduler sees of it (`scheduling`), each stage's Job or JobSet (`jobs`, `jobset`), the run
driver's objects (`driver_objects`), all a run applies (`run_objects`), the namespace's one-time setup
(`namespace_setup`), and the same objects as kustomize bases (`base`, written by `yaml_out`)."""
