"""`RunConfig`: everything one pipeline run needs to be rendered into Kubernetes Jobs, in one file.

A run is described once, in TOML or JSON (`load_run_config`): its id and storage root, the namespace,
the images, the target model, the source data, how pods reach S3, and per stage the shard count,
resources, placement and stage config overrides. Stage settings given in the file are merged over the
stage's own defaults (a file that sets only `stages.generate.shards` keeps generate's GPU defaults).
"""

from __future__ import annotations

import json
import re
import tomllib
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_pipeline.run.k8s_names import AnnotationMap, ExtraResources, LabelMap, LabelValue
from dflash_pipeline.run.pilot_settings import PilotSettings
from dflash_pipeline.run.plan_inputs import PlanInputs
from dflash_shared.errors import ConfigError
from dflash_shared.settings import SECRET_NAME

# Kubernetes quantities as written in manifests ("500m", "4", "16Gi", "1.5G"); the schema validator
# does not check them, so a typo like "16GB" would otherwise only fail at `kubectl apply`.
_QUANTITY = re.compile(r"^(\d+(\.\d+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_SUFFIX = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
    "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
    "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_CONFIG_KEY = re.compile(r"^[a-z][a-z0-9_]*(__[a-z][a-z0-9_]*)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Leaves room for "dflash-" + run id + "-" + the longest stage name and the pod index suffix in 63 chars.
MAX_RUN_ID = 36


def quantity_value(text: str) -> Decimal:
    """The numeric value of a Kubernetes quantity ('16Gi' -> 17179869184)."""
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (examples: '500m', '4', '16Gi')")
    return Decimal(match.group(1)) * _SUFFIX[match.group(3) or ""]


def _check_quantity(text: str) -> str:
    quantity_value(text)
    return text


def _check_dns_label(text: str) -> str:
    if len(text) > 63 or not _DNS_LABEL.match(text):
        raise ValueError(f"{text!r} must be a DNS label: lowercase letters, digits and '-', at most 63 characters")
    return text


Quantity = Annotated[str, AfterValidator(_check_quantity)]
DnsLabel = Annotated[str, AfterValidator(_check_dns_label)]
ConfigValue = str | int | float | bool | list[Any] | dict[str, Any]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Toleration(_Frozen):
    """A pod toleration, as in the Kubernetes API."""

    key: str | None = Field(default=None, description="Taint key; None with operator Exists tolerates all taints.")
    operator: Literal["Exists", "Equal"] = Field(default="Exists", description="How the taint value is matched.")
    value: str | None = Field(default=None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect tolerated; None tolerates every effect."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: how long to stay.")

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "operator": self.operator, "value": self.value,
                               "effect": self.effect, "tolerationSeconds": self.toleration_seconds}
        return {k: v for k, v in out.items() if v is not None}


class JobSettings(_Frozen):
    """How one stage runs on the cluster: its shards, resources, placement and config overrides."""

    shards: int = Field(default=1, ge=1, le=100_000, description="Pods of the Indexed Job (completions = parallelism).")
    retries_per_shard: int = Field(default=3, ge=0, le=100, description="backoffLimitPerIndex: retries of one shard.")
    max_failed_shards: int | None = Field(
        default=None, ge=0, description="maxFailedIndexes: fail the Job once more shards than this have failed."
    )
    cpu: Quantity = Field(default="1", description="CPU request of the stage container.")
    memory: Quantity = Field(default="2Gi", description="Memory request of the stage container.")
    cpu_limit: Quantity | None = Field(default=None, description="CPU limit; None leaves CPU unthrottled.")
    memory_limit: Quantity | None = Field(default=None, description="Memory limit; None means equal to the request.")
    scratch_size: Quantity = Field(
        default="10Gi",
        description="Working space of the scratch emptyDir (TMPDIR) besides the target copy: a stage that copies the "
        "target there gets target.disk_size more (sizeLimit and ephemeral-storage request).",
    )
    home_size: Quantity = Field(default="2Gi", description="sizeLimit of the home emptyDir (library caches).")
    shm_size: Quantity | None = Field(
        default=None, description="Memory-backed /dev/shm of this size (GPU stages); counts against memory."
    )
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs per pod (0: a CPU stage).")
    nodes: int = Field(
        default=1, ge=1, le=1024,
        description="Pods that run one stage process group together (train: one torchrun per pod, joined by a "
        "c10d rendezvous). Only the train stage takes more than 1; the others scale with `shards`.",
    )
    gang: Literal["indexed-job", "jobset"] = Field(
        default="indexed-job",
        description="How a multi-node stage's pods run together: an Indexed Job the run driver creates (a failed "
        "pod is replaced alone) or a JobSet (needs the JobSet controller; the whole gang restarts). See k8s/README.md.",
    )
    rendezvous_timeout_seconds: int = Field(
        default=600, ge=60, le=7200,
        description="How long the torchruns of a multi-node stage wait for every node at the c10d rendezvous "
        "(join_timeout). A rank that cannot come back costs the other pods this long per retry, so it bounds how "
        "long they hold their GPUs (k8s/README.md, \"A lost node\").",
    )
    min_parallelism: int | None = Field(
        default=None, ge=1,
        description="Kueue partial admission of a sharded stage (Job annotation kueue.x-k8s.io/job-min-parallelism): "
        "Kueue may admit the Job with fewer pods, down to this many, when the quota for all is not free; the "
        "remaining shards run as admitted pods finish. Needs Kueue's PartialAdmission (beta, on by default).",
    )
    exclusive_topology: str | None = Field(
        default=None,
        description="JobSet only: a node label key (a node pool, a rack, an NVLink domain) whose value all pods "
        "of the gang share, one gang per domain (annotation alpha.jobset.sigs.k8s.io/exclusive-topology).",
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name of a GPU.")
    gpu_types: list[str] = Field(
        default_factory=list, description="Allowed GPU products (node affinity on gpu_type_label); empty: any."
    )
    gpu_type_label: str = Field(default="nvidia.com/gpu.product", description="Node label naming the GPU product.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations.")
    runtime_class_name: str | None = Field(default=None, description="Pod runtimeClassName (e.g. 'nvidia').")
    priority_class_name: str | None = Field(
        default=None, description="Pod priorityClassName; default: scheduling.priority_class_name."
    )
    queue_name: LabelValue | None = Field(
        default=None, description="Kueue LocalQueue of this stage's Job; default: scheduling.queue_name."
    )
    workload_priority_class: LabelValue | None = Field(
        default=None, description="Kueue WorkloadPriorityClass of this stage; default: scheduling's."
    )
    job_labels: LabelMap = Field(default_factory=dict, description="Job labels, over scheduling.job_labels.")
    job_annotations: AnnotationMap = Field(
        default_factory=dict, description="Job annotations, over scheduling.job_annotations."
    )
    pod_labels: LabelMap = Field(default_factory=dict, description="Pod labels, over scheduling.pod_labels.")
    pod_annotations: AnnotationMap = Field(
        default_factory=dict, description="Pod annotations, over scheduling.pod_annotations."
    )
    extra_resources: ExtraResources = Field(
        default_factory=dict,
        description="Extended resources per pod besides the GPUs, requested and limited alike (devices cannot be "
        "overcommitted): e.g. {\"rdma/ib\" = \"1\"} for InfiniBand/RoCE through an RDMA device plugin.",
    )
    termination_grace_seconds: int = Field(
        default=120, ge=1, description="Time between SIGTERM and SIGKILL: enough to commit the shard in flight."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=0,
        description="Job activeDeadlineSeconds: the whole Job fails (its pods are stopped) once it has run this "
        "long, so a hung pod cannot hold its GPUs forever. Each stage has a default (STAGE_DEFAULTS); 0: none.",
    )
    ttl_seconds_after_finished: int = Field(
        default=3 * 86400, ge=0, description="Delete the finished Job (and its pods) after this long."
    )
    config: dict[str, ConfigValue] = Field(
        default_factory=dict,
        description="Stage config overrides by field name (max_length = 8192 becomes DFLASH_<STAGE>_MAX_LENGTH).",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra plain environment variables (not DFLASH_*, no credentials)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSettings:
        for request, limit, what in ((self.memory, self.memory_limit, "memory"), (self.cpu, self.cpu_limit, "cpu")):
            if limit is not None and quantity_value(limit) < quantity_value(request):
                raise ValueError(f"{what}_limit {limit} is below the {what} request {request}")
        if self.max_failed_shards is not None and self.max_failed_shards > self.shards:
            raise ValueError(f"max_failed_shards {self.max_failed_shards} exceeds shards {self.shards}")
        if self.min_parallelism is not None and self.min_parallelism > self.shards:
            raise ValueError(f"min_parallelism {self.min_parallelism} exceeds shards {self.shards}")
        if self.gpu_types and not self.gpus:
            raise ValueError("gpu_types is set but gpus is 0")
        if self.gpu_resource in self.extra_resources:
            raise ValueError(f"extra_resources names the GPU resource {self.gpu_resource!r}; set `gpus` instead")
        for key in self.config:
            if not _CONFIG_KEY.match(key):
                raise ValueError(f"config key {key!r} must be a stage config field name such as 'max_length'")
            if SECRET_NAME.search(key):
                raise ValueError(f"config key {key!r} looks like a credential; put it in the Secret instead")
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"env name {name!r} is not a valid environment variable name")
            if name.upper().startswith("DFLASH_"):
                raise ValueError(f"env {name!r}: set stage settings through `config`, which checks their names")
            if SECRET_NAME.search(name) or name.upper().startswith("AWS_"):
                raise ValueError(f"env {name!r}: credentials and S3 settings belong in [storage] or the Secret")
        return self


HOUR = 3600
DAY = 24 * HOUR
# Per-stage defaults, merged under whatever the run file sets for that stage.
#
# Deadlines (activeDeadlineSeconds) bound a Job that stopped making progress without exiting (a hung NCCL
# collective, an engine that deadlocked): without one it holds its nodes forever. Each is several times what
# the stage takes on a headline run (Qwen3.6-27B, ~900K prompts, 64 generate pods, 4 x 8-GPU training:
# `pipeline plan` says), so preemptions and retries fit; a Job stopped by its deadline continues from its
# committed shards or checkpoint after `pipeline resume`. Scratch sizes exclude the target copy (added per run).
STAGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "import": {"cpu": "1", "memory": "2Gi", "scratch_size": "10Gi", "termination_grace_seconds": 60,
               "active_deadline_seconds": 6 * HOUR},
    "generate": {
        "gpus": 1, "cpu": "8", "memory": "64Gi", "scratch_size": "20Gi", "home_size": "20Gi", "shm_size": "16Gi",
        "termination_grace_seconds": 300, "active_deadline_seconds": 3 * DAY,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "tokenize": {"cpu": "4", "memory": "8Gi", "scratch_size": "20Gi", "active_deadline_seconds": 12 * HOUR},
    # Scratch holds the data shard cache beside the target copy (the stage's preflight wants 200 GiB free by
    # default); the grace period covers finishing the step in flight and writing its checkpoint.
    "train": {
        "gpus": 1, "cpu": "16", "memory": "128Gi", "scratch_size": "200Gi", "home_size": "20Gi", "shm_size": "16Gi",
        "termination_grace_seconds": 900, "active_deadline_seconds": 7 * DAY,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    # Reads the final checkpoint's weights on the CPU and writes the serving files.
    "export": {"cpu": "4", "memory": "32Gi", "scratch_size": "50Gi", "home_size": "5Gi",
               "active_deadline_seconds": 6 * HOUR},
    # One process on one GPU: the target and two drafters (trained, untrained baseline) in memory.
    "evaluate": {
        "gpus": 1, "cpu": "8", "memory": "64Gi", "scratch_size": "20Gi", "home_size": "20Gi", "shm_size": "8Gi",
        "termination_grace_seconds": 60, "active_deadline_seconds": 1 * DAY,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    # vLLM on the target with the exported drafter, then without it: like a generate pod, one engine.
    "serve-check": {
        "gpus": 1, "cpu": "8", "memory": "64Gi", "scratch_size": "20Gi", "home_size": "20Gi", "shm_size": "16Gi",
        "termination_grace_seconds": 60, "active_deadline_seconds": 1 * DAY,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}


class StagesSettings(_Frozen):
    """Settings of every stage; a stage's table in the run file only needs the keys that differ."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    import_: JobSettings = Field(alias="import", description="Import of the source conversations (CPU).")
    generate: JobSettings = Field(description="Completion generation with the target model (GPU).")
    tokenize: JobSettings = Field(description="Tokenization and loss masking (CPU).")
    train: JobSettings = Field(description="Drafter training against the frozen target (GPU; one or more nodes).")
    export: JobSettings = Field(description="Serving files of the trained drafter (CPU).")
    evaluate: JobSettings = Field(description="Offline acceptance of the exported drafter (GPU).")
    serve_check: JobSettings = Field(
        alias="serve-check", description="The exported drafter in vLLM: engine tau against offline tau (GPU)."
    )

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        data = dict(data or {})
        for field, alias in (("import_", "import"), ("serve_check", "serve-check")):
            if field in data and alias not in data:
                data[alias] = data.pop(field)
        for stage, defaults in STAGE_DEFAULTS.items():
            given = data.get(stage, {})
            if isinstance(given, BaseModel):
                continue
            data[stage] = {**defaults, **(given or {})}
        return data

    def for_stage(self, name: str) -> JobSettings:
        settings = getattr(self, "import_" if name == "import" else name.replace("-", "_"), None)
        if not isinstance(settings, JobSettings):
            raise ConfigError(f"no settings for stage {name!r}")
        return settings


IMAGE_NAMES = ("tokenizer", "generator", "trainer", "pipeline")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# Tags that move with every build: a Job the run driver creates days after `kubectl apply` would run whatever
# build each node happens to have cached under them.
MOVING_TAGS = frozenset({"latest"})


def _check_digests(values: dict[str, str]) -> dict[str, str]:
    for name, digest in values.items():
        if name not in IMAGE_NAMES:
            raise ValueError(f"digests: unknown image {name!r}; the images are {', '.join(IMAGE_NAMES)}")
        if not _DIGEST.match(digest):
            raise ValueError(f"digests.{name}: {digest!r} is not an image digest (sha256: and 64 hex digits)")
    return values


class ImageSettings(_Frozen):
    """Where the stage images come from: <registry>/dflash-<name>:<tag>@<digest>.

    A digest pins the exact build: every pod of a run, created at apply time or days later by the run driver,
    runs the same image whatever a node has cached. `make build-images` records each image's digest in a
    JSON file that `digests_file` names.
    """

    registry: str = Field(default="localhost", description="Registry and path prefix of the images.")
    tag: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$",
        description="Image tag (the git revision build-images tags each image with); 'latest' is refused. "
        "Optional where every image has a digest.",
    )
    digests: Annotated[dict[str, str], AfterValidator(_check_digests)] = Field(
        default_factory=dict,
        description="Image name (tokenizer, generator, trainer, pipeline) -> 'sha256:...' digest; references "
        "are then rendered by digest. Over the ones read from digests_file.",
    )
    digests_file: str | None = Field(
        default=None,
        description="JSON file written by `make build-images` (build/images/digests.json), relative to the run "
        "file: its digests are used for the images `digests` does not name.",
    )
    require_digests: bool = Field(
        default=False, description="Refuse to render an image reference without a digest."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="imagePullPolicy of every container."
    )
    pull_secrets: list[str] = Field(default_factory=list, description="imagePullSecrets names.")

    @model_validator(mode="after")
    def _pinned(self) -> ImageSettings:
        if self.tag in MOVING_TAGS:
            raise ValueError(
                f"tag {self.tag!r} moves with every build: a stage Job created days after apply would run whatever "
                "each node has cached; use the git revision docker/build-images.sh tags, and digests_file")
        return self

    def ref(self, name: str) -> str:
        """`<registry>/dflash-<name>[:<tag>][@<digest>]`; kubelets pull by the digest when there is one."""
        digest = self.digests.get(name)
        if digest is None and (self.require_digests or self.tag is None):
            why = "images.require_digests is set" if self.require_digests else "images.tag is not set"
            raise ConfigError(f"image dflash-{name} has no digest and {why}: run `make build-images` and name its "
                              "digests file in images.digests_file, or set images.digests")
        tag = f":{self.tag}" if self.tag else ""
        return f"{self.registry.rstrip('/')}/dflash-{name}{tag}" + (f"@{digest}" if digest else "")


class TargetModel(_Frozen):
    """The target model the drafter is trained for."""

    model_id: str = Field(description="Model id recorded in manifests (e.g. 'Qwen/Qwen3-8B').")
    revision: str | None = Field(default=None, description="Model revision (commit or tag) recorded in manifests.")
    uri: str = Field(
        description="Directory (s3:// or a path inside the container) with the weights, tokenizer.json and chat "
        "template."
    )
    enable_thinking: bool | None = Field(
        default=None, description="Thinking mode for generation and tokenization; None keeps each stage's default."
    )
    allow_size_mismatch: bool = Field(
        default=False,
        description="The fit check refuses a target whose config.json has 1.5 times more or fewer parameters than "
        "model_id states ('27B'): the wrong model staged at target.uri. True accepts it (a model whose name "
        "states another size).",
    )
    disk_size: Quantity | None = Field(
        default=None,
        description="Bytes of the model directory, which the GPU stages copy to their scratch: sizes their "
        "ephemeral-storage requests. Default: the parameter count in model_id ('27B') x 2 bytes (bf16) + 10%.",
    )


class SourceData(_Frozen):
    """The external conversations a run starts from."""

    kind: Literal["prompts", "completions"] = Field(
        description="prompts: conversations to regenerate with the target (import -> generate -> tokenize); "
        "completions: finished conversations used as they are (import -> tokenize)."
    )
    uri: str = Field(
        description="The import's source: a .jsonl(.zst|.gz) or .parquet file or a prefix of them, a folder written "
        "by datasets' save_to_disk (the stage images do not ship datasets, which a hf:// source needs), or a stage "
        "output of another run: its prefix or manifest.json, read through the manifest. Another run's completions "
        "with kind = \"completions\" are copied with the engine's token ids and target identity, and the import's "
        "manifest names theirs as its input (retraining on existing completions: docs/contract.md)."
    )


class StorageAccess(_Frozen):
    """How pods reach S3. Credentials never appear in a manifest: a Secret is referenced by name only."""

    credentials: Literal["secret", "workload_identity"] = Field(
        default="secret",
        description="secret: the keys of a Secret (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) become "
        "environment variables; workload_identity: the ServiceAccount carries the cloud identity.",
    )
    secret_name: str | None = Field(default=None, description="Secret name (credentials = secret); default dflash-s3.")
    service_account: DnsLabel = Field(default="dflash-pipeline", description="ServiceAccount the pods run as.")
    service_account_annotations: dict[str, str] = Field(
        default_factory=dict, description="Annotations of that ServiceAccount (e.g. the cloud role to assume)."
    )
    endpoint_url: str | None = Field(
        default=None, pattern=r"^https?://\S+$", description="AWS_ENDPOINT_URL for S3-compatible stores (MinIO)."
    )
    region: str | None = Field(default=None, description="AWS_REGION.")
    checksum_when_required: bool = Field(
        default=False, description="Send S3 checksums only when required (stores that reject botocore's default)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> StorageAccess:
        if self.credentials == "workload_identity" and self.secret_name is not None:
            raise ValueError("secret_name is set but credentials = 'workload_identity'; choose one")
        return self

    @property
    def secret(self) -> str | None:
        """Name of the credentials Secret, or None with workload identity."""
        if self.credentials != "secret":
            return None
        return self.secret_name or "dflash-s3"


class SchedulingSettings(_Frozen):
    """Run-wide hooks for the cluster's scheduler and admission (Kueue), webhooks and policies.

    Every stage inherits these; a stage's own settings of the same name win (maps: key by key). Labels and
    annotations go where their consumer reads them: Kueue and most policies read the Job's, webhooks that
    mutate pods (Azure workload identity's `azure.workload.identity/use`, Multus networks) read the pod's.
    """

    queue_name: LabelValue | None = Field(
        default=None,
        description="Kueue LocalQueue: the Job label kueue.x-k8s.io/queue-name. Kueue then creates each Job "
        "suspended and admits it when the queue's quota fits all its pods.",
    )
    workload_priority_class: LabelValue | None = Field(
        default=None, description="Kueue WorkloadPriorityClass: the Job label kueue.x-k8s.io/priority-class."
    )
    driver_queue_name: LabelValue | None = Field(
        default=None,
        description="Kueue LocalQueue of the run driver's Job; default none: the driver, which must run for any "
        "stage Job to exist, is never queued behind the stages' quota (see k8s/README.md).",
    )
    priority_class_name: str | None = Field(
        default=None, description="Pod priorityClassName (kube-scheduler priority and preemption); the run "
        "driver's too.",
    )
    job_labels: LabelMap = Field(default_factory=dict, description="Labels of every Job.")
    job_annotations: AnnotationMap = Field(default_factory=dict, description="Annotations of every Job.")
    pod_labels: LabelMap = Field(default_factory=dict, description="Labels of every pod.")
    pod_annotations: AnnotationMap = Field(default_factory=dict, description="Annotations of every pod.")


class RunConfig(_Frozen):
    """One pipeline run: rendered into the Jobs of every stage with their prefixes wired together."""

    run_id: str = Field(description=f"Run id: a DNS label of at most {MAX_RUN_ID} characters.")
    root: str = Field(description="s3://bucket/prefix under which <run_id>/<kind> prefixes are made.")
    namespace: DnsLabel = Field(default="dflash", description="Namespace of every object.")
    create_namespace: bool = Field(
        default=False,
        description="Put the Namespace (labelled for the restricted Pod Security Standard) into the one-time "
        "namespace setup (`render --setup`, k8s/namespace). Never part of a run's own objects: deleting one run "
        "must not delete the namespace and every other run in it.",
    )
    images: ImageSettings = Field(default_factory=ImageSettings, description="Stage images.")
    target: TargetModel = Field(description="Target model.")
    source: SourceData = Field(description="Source conversations.")
    storage: StorageAccess = Field(default_factory=StorageAccess, description="S3 access of the pods.")
    stages: StagesSettings = Field(default_factory=lambda: StagesSettings.model_validate({}),
                                   description="Per-stage settings.")
    scheduling: SchedulingSettings = Field(
        default_factory=SchedulingSettings, description="Labels, annotations, queue and priority of every stage."
    )
    plan: PlanInputs = Field(default_factory=PlanInputs,
                             description="Workload and throughput figures for `pipeline plan` (sizing only).")
    pilot: PilotSettings = Field(default_factory=PilotSettings,
                                 description="The counts of this run's pilot (`pipeline pilot`); shapes stay.")
    pilot_of: str | None = Field(
        default=None,
        description="Set by `pipeline pilot` on the run it derives: the run id this run is the pilot of (its "
        "report.json is written when it ends). Not for run files.",
    )

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if len(self.run_id) > MAX_RUN_ID or not _DNS_LABEL.match(self.run_id):
            raise ValueError(
                f"run_id {self.run_id!r} must be lowercase letters, digits and '-', at most {MAX_RUN_ID} characters "
                "(it names the Jobs)"
            )
        # A local directory serves `pipeline local` (the demo); rendered Jobs refuse it (see jobs.py).
        is_local = self.root.startswith("/")
        if not is_local and (not self.root.startswith("s3://") or len(self.root.rstrip("/")) <= len("s3://")):
            raise ValueError(
                f"root {self.root!r} must be an s3://bucket[/prefix] URI (pods exchange data through S3), or an "
                "absolute directory for a local run"
            )
        return self


def _describe(err: ValidationError, origin: str) -> str:
    problems = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(file)"
        problems.append(f"{where}: {item['msg']}")
    return f"invalid run config {origin}: " + "; ".join(problems)


def parse_run_config(data: dict[str, Any], origin: str = "(data)") -> RunConfig:
    """Validate a run config given as data; errors name the file and the dotted field."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, origin)) from err


def read_run_file(path: str | Path) -> dict[str, Any]:
    """The raw data of a .toml or .json run file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read run config {path}: {err.strerror}") from err
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(raw.decode("utf-8"))
        elif path.suffix == ".json":
            data = json.loads(raw)
        else:
            raise ConfigError(f"run config {path} must end in .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"run config {path} is not valid {path.suffix[1:].upper()}: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"run config {path} must hold a table/object at the top level")
    return data


def read_digests_file(path: Path) -> dict[str, str]:
    """Image name -> digest from the file `docker/build-images.sh` writes (`{"images": {name: {"digest": ...}}}`)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read images.digests_file {path}: {err.strerror}; run `make build-images`, "
                          "which writes it") from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"images.digests_file {path} is not JSON: {err}") from err
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, dict):
        raise ConfigError(f"images.digests_file {path} has no \"images\" object")
    # Only the images runs use; the file may also list others build-images made.
    return {name: str(entry["digest"]) for name, entry in images.items()
            if name in IMAGE_NAMES and isinstance(entry, dict) and entry.get("digest")}


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a run file (.toml or .json); a digests_file is read relative to the run file."""
    path = Path(path)
    data = read_run_file(path)
    images = data.get("images")
    if isinstance(images, dict) and isinstance(images.get("digests_file"), str):
        recorded = read_digests_file(path.parent / images["digests_file"])
        data = {**data, "images": {**images, "digests": {**recorded, **(images.get("digests") or {})}}}
    return parse_run_config(data, str(path))
