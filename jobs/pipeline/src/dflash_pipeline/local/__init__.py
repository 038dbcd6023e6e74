"""A run on this machine: every stage as a process with its Kubernetes Job's settings (`runner`), and what a
person sees of it on the console (`console`)."""
