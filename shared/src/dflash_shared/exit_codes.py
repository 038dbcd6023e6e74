"""Exit codes shared by every stage, chosen so a scheduler can act on them without reading logs.

The values follow BSD ``sysexits.h`` where one fits, so they do not collide with shell conventions
(126/127 for exec failures, 128+N for deaths by signal N).

========  ===========  ==========================================================================
Code      Name         Meaning and what to do
========  ===========  ==========================================================================
0         OK           The stage finished; its output (or this shard's) is committed.
1         RETRYABLE    Unexpected error or a transient storage/network failure. Retry the pod.
64        USAGE        Bad configuration or arguments. Do not retry; fix the config.
65        BAD_INPUT    The input failed the quality gate, or an input manifest is incompatible or
                       corrupt. Do not retry; a Job's podFailurePolicy maps it to ``FailJob``.
69        ENVIRONMENT  Preflight found the node or its access unfit (no GPU, too little disk or
                       /dev/shm, no S3 access, wrong image contents). A retry may land on a
                       better node.
75        PREEMPTED    SIGTERM (or SIGINT) received; work done so far is committed and a rerun
                       resumes from it. Retry.
========  ===========  ==========================================================================

Which failure gets which code, decided in one place (`dflash_shared.errors.exit_code_for`) for every
entry point:

=====================================================================  ===========
Failure                                                                Code
=====================================================================  ===========
unknown flag or ``DFLASH_*`` variable, invalid value, missing setting  USAGE
a configured path that is missing or unusable (tokenizer or target     USAGE
directory without tokenizer.json or a chat template, a config file, an
import source file of a type it does not read, a Hub dataset that does
not exist)
a shard or a resume under other settings than its output was made      USAGE
with (`dflash_shared.stage_identity`)
a local path that cannot be read or written (permission denied,        ENVIRONMENT
read-only filesystem, disk full)
S3 credentials missing or refused, a missing bucket, no endpoint       ENVIRONMENT
a failed preflight check of the node (GPU, disk, /dev/shm, imports)    ENVIRONMENT
the quality gate, an input manifest that is missing, incompatible or   BAD_INPUT
corrupt, an input shard that does not match its manifest
SIGTERM or SIGINT                                                      PREEMPTED
a storage failure that may pass (throttling, a dropped connection),    RETRYABLE
anything unforeseen
=====================================================================  ===========

Configuration and access failures are found before the first record is read: `import` and `run` start
with preflight's storage, tokenizer and output checks.

A Kubernetes Job can encode the table directly::

    podFailurePolicy:
      rules:
        - action: FailJob
          onExitCodes: {operator: In, values: [64, 65]}
        - action: Ignore          # preemption does not count against backoffLimit
          onExitCodes: {operator: In, values: [75]}
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit status of a stage; see the module docstring for the retry policy of each."""

    OK = 0
    RETRYABLE = 1
    USAGE = 64
    BAD_INPUT = 65
    ENVIRONMENT = 69
    PREEMPTED = 75

    @property
    def retryable(self) -> bool:
        """Whether rerunning the same pod can succeed without a change to config or input."""
        return self in (ExitCode.RETRYABLE, ExitCode.ENVIRONMENT, ExitCode.PREEMPTED)


def describe(code: int) -> str:
    """'65 (BAD_INPUT)' for known codes, the bare number otherwise."""
    try:
        return f"{code} ({ExitCode(code).name})"
    except ValueError:
        return str(code)
