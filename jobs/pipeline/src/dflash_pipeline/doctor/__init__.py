"""`doctor`: the run file checked against the cluster and the object store before the pilot holds any GPU.

One verdict per check, each failure with its fix (`checks`: the cluster's objects and nodes; `image_probe`: each
stage image pulled by a short pod on the nodes the stage would run on; `command`: the list, run as one
Preflight, exit 0 or 69).
"""
