"""What a run is, before anything is rendered: the run file (`config`, with its `[plan]` inputs, `[pilot]` counts
and the Kubernetes names it may set), the run's prefixes (`layout`), what each stage is and how it is wired to
them (`stages`), and the object store as a command beside the cluster reaches it (`endpoint`)."""
