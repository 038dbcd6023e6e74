"""The train stage end to end on S3: compatibility refusal, config resolution, the drafter manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_shared.errors import ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import ManifestError, load_manifest
from dflash_shared.manifests import DrafterSection, Kind, TokenizedSection
from dflash_shared.settings import parse_settings
from dflash_shared.storage import ObjectStore, join
from dflash_train.config import TrainConfig, debug
from dflash_train.drafter.resolve import resolve_drafter
from dflash_train.publish import build_manifest
from dflash_train.stage import run
from tests.train.train_fixtures import (
    SMALL_MASK_ID,
    identity_of,
    small_vocab_target,
    synthetic_docs,
    tiny_target,
    write_tokenized,
)


def other_template_target(tmp_path: Path) -> Path:
    """The tiny target's tokenizer with a chat template that differs by one character."""
    target = tmp_path / "other-target"
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copyfile(tiny_target() / name, target / name)
    template = (tiny_target() / "tokenizer_config.json").read_text()
    (target / "chat_template.jinja").write_text("{# v2 #}" + template[:100])
    return target


def test_data_made_with_another_template_is_refused_before_loading(tmp_path: Path) -> None:
    store = ObjectStore()
    data = write_tokenized(store, str(tmp_path / "tok"), synthetic_docs(10), identity_of(tiny_target()))
    config = debug(data, str(tmp_path / "out"), str(other_template_target(tmp_path)),
                   scratch_dir=str(tmp_path / "scratch"))
    with pytest.raises(ManifestError) as caught:
        run(config, store)
    assert caught.value.field == "target.chat_template_sha256"
    assert exit_code_for(caught.value) is ExitCode.BAD_INPUT
    assert not store.list(str(tmp_path / "out"))


def test_presets_and_drafter_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--input", "in", "--output", "out", "--target", "t"]
    plain = parse_settings(TrainConfig, args)
    assert plain.lr == 6e-4 and plain.precision == "bf16" and plain.epochs == 6
    monkeypatch.setenv("DFLASH_TRAIN_LR", "0.01")
    tuned = parse_settings(TrainConfig, [*args, "--preset", "debug", "--max-steps", "3"])
    # The preset fills what was not given; flags and environment variables win over it.
    assert (tuned.device, tuned.max_length, tuned.max_steps, tuned.lr) == ("cpu", 256, 3, 0.01)
    with pytest.raises(ConfigError, match="drafter_overrides has unknown key"):
        parse_settings(TrainConfig, [*args, "--drafter-overrides", '{"num_layer": 3}'])

    section = TokenizedSection(target=identity_of(tiny_target()), mode="render", mask_policy="final_turn",
                               max_length=512, total_tokens=0, loss_tokens=0)
    shaped = TrainConfig(input="in", output="out", target="t",
                         drafter_overrides={"num_layers": 1, "target_layer_ids": [0, 2], "block_size": 8})
    cfg = resolve_drafter(shaped, str(tiny_target()), section)
    # The target's own layer shape (hidden 128, 2/1 heads of 64), the mask from the data's manifest.
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 2, 1, 64)
    assert (cfg.num_layers, cfg.target_layer_ids, cfg.block_size) == (1, [0, 2], 8)
    # The loss decay is the run's recipe: exp_decay's default gamma follows the resolved block size.
    assert shaped.model_copy(update={"position_weighting": "exp_decay"}).recipe.decay_gamma(cfg.block_size) == 4.0
    assert cfg.mask_token_id == section.target.special_tokens.mask
    no_mask = section.model_copy(update={"target": section.target.model_copy(update={
        "special_tokens": section.target.special_tokens.model_copy(update={"mask": None})})})
    # Without one anywhere, the reference choice: the first embedding row past the tokenizer (Qwen3: 151669).
    assert resolve_drafter(shaped, str(tiny_target()), no_mask).mask_token_id == 151669
    with pytest.raises(ConfigError, match="repeats a layer"):
        resolve_drafter(shaped.model_copy(update={"drafter_overrides": {"target_layer_ids": [1, 1]}}),
                        str(tiny_target()), section)


class _Rank0:
    """The distributed environment of a single process, as plan_data needs it."""

    rank, world_size = 0, 1

    @staticmethod
    def all_gather_object(obj: object) -> list[object]:
        return [obj]


class _RecordingStore(ObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.downloaded: list[str] = []

    def download_to(self, uri: str, local_path: str) -> None:
        self.downloaded.append(uri)
        super().download_to(uri, local_path)


def test_training_never_reads_the_heldout_split(tmp_path: Path) -> None:
    from dflash_train.data.loader import StepLoader
    from dflash_train.data.shards import ShardCache
    from dflash_train.prepare import plan_data, resolve
    from dflash_train.publish import trained_tokens

    store = _RecordingStore()
    train_docs = synthetic_docs(30, max_len=60)  # token ids below 1,100
    # Held-out documents use ids no training document has: one of them in a batch would show.
    heldout_docs = [([5000 + t for t in ids], mask) for ids, mask in synthetic_docs(8, seed=1, max_len=60)]
    data = write_tokenized(store, str(tmp_path / "tok"), train_docs, identity_of(tiny_target()), shards=2,
                           heldout=heldout_docs)
    config = debug(data, str(tmp_path / "out"), str(tiny_target()), scratch_dir=str(tmp_path / "scratch"),
                   max_length=64, batch_tokens=128)
    resolved = resolve(config, store, str(tiny_target()))
    heldout_uris = {s.uri for s in resolved.source.manifest.shards if s.split == "heldout"}
    assert len(heldout_uris) == 1 and len(resolved.train_shards) == 2
    cache = ShardCache(store, str(tmp_path / "cache"), 2**30)
    plan = plan_data(resolved, store, cache, _Rank0())
    steps = 2 * plan.rows_per_epoch // resolved.rows_per_step  # two epochs
    loader = StepLoader(plan, cache, resolved.rows_per_step, 1, 0, 1, 0, steps)
    seen: set[int] = set()
    try:
        for item in loader:
            for batch in item.micro:
                seen.update(batch.input_ids.flatten().tolist())
    finally:
        loader.close()
        cache.close()
    assert not {t for t in seen if t >= 5000}, "a held-out document reached a training batch"
    assert {t for ids, _ in train_docs for t in ids} <= seen
    assert store.downloaded and not heldout_uris & set(store.downloaded)
    # The drafter manifest counts the held-out records as left out of training on purpose, and what the rows
    # read of the train split: every token (no document passes the 64-token window), twice.
    tokens = trained_tokens(plan, steps, resolved.rows_per_step)
    manifest = build_manifest(resolved, _FakeCheckpoint(str(tmp_path / "ckpt")), {}, {}, tokens)
    accounting = manifest.accounting
    assert (accounting.input_records, accounting.succeeded, accounting.skipped) == (38, 30, 8)
    assert accounting.skips_by_reason == {"heldout": 8}
    data_section = manifest.section.data  # type: ignore[union-attr]
    assert data_section is not None and data_section == tokens
    loss = sum(sum(mask) for _, mask in train_docs)
    assert (data_section.max_length, data_section.tokens_available, data_section.tokens_trained) == (
        64, sum(len(ids) for ids, _ in train_docs), sum(len(ids) for ids, _ in train_docs))
    assert (data_section.loss_tokens_available, data_section.window_fraction, data_section.epochs) == (loss, 1.0, 2.0)


class _FakeCheckpoint:
    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.marker = type("Marker", (), {"files": {}})()


@pytest.mark.slow
def test_stage_on_s3_writes_the_drafter_manifest_last(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    target = join(s3_bucket, "models", "tiny")
    for path in small_vocab_target().iterdir():
        if path.is_file() and not path.name.startswith("."):
            store.upload_from(str(path), join(target, path.name))
    data = write_tokenized(store, join(s3_bucket, "tok"), synthetic_docs(40, max_len=60),
                           identity_of(small_vocab_target()), shards=3)
    out = join(s3_bucket, "drafter")
    config = debug(data, out, target, scratch_dir=str(tmp_path / "scratch"), max_steps=3, max_length=64,
                   batch_tokens=128, checkpoint_every=2, mask_token_id=SMALL_MASK_ID,
                   num_anchors=2)
    uri = run(config, store)
    assert uri == join(out, "manifest.json")
    loaded = load_manifest(store, out, Kind.drafter)  # re-hashes every listed checkpoint file
    m, section = loaded.manifest, loaded.manifest.section
    tokenized = load_manifest(store, data, Kind.tokenized)
    assert isinstance(section, DrafterSection) and isinstance(tokenized.manifest.section, TokenizedSection)
    assert [(i.uri, i.sha256, i.kind) for i in m.inputs] == [(tokenized.uri, tokenized.sha256, Kind.tokenized)]
    assert section.target == tokenized.manifest.section.target.model_copy(update={
        "special_tokens": tokenized.manifest.section.target.special_tokens.model_copy(update={"mask": SMALL_MASK_ID})})
    assert (section.target_layer_ids, section.block_size, section.mask_token_id) == ([1, 2], 8, SMALL_MASK_ID)
    assert section.checkpoint_uri == join(out, "checkpoints", "step-00000003")
    assert {s.uri.rsplit("/", 1)[-1] for s in m.shards} == {
        "model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "drafter_config.json"}
    assert {"loss", "tau", "accuracy", "acc_1", "acc_7"} <= set(section.final_metrics)
    # Documents of at most 60 tokens in rows of 64: the window reads all of them.
    assert section.data is not None and (section.data.max_length, section.data.window_fraction) == (64, 1.0)
    assert section.data.tokens_trained == section.data.tokens_available == tokenized.manifest.section.total_tokens
    resolved = m.producer.config["resolved"]
    assert resolved["drafter"]["mask_token_id"] == SMALL_MASK_ID and resolved["total_steps"] == 3
    assert m.producer.config["max_steps"] == 3 and m.accounting.input_records == 40
    assert store.list(join(out, "tensorboard")) and store.exists(join(out, "train", "plan.json"))
    # Only the newest checkpoints are kept (2 by default); the step-2 one stays beside the final one.
    assert [u.rsplit("/", 2)[-2] for u in store.list(join(out, "checkpoints")) if u.endswith("COMPLETE.json")] == [
        "step-00000002", "step-00000003"]

    # Once the manifest exists a rerun does nothing; a resume with another data order (seed) is refused.
    assert run(config, store) == uri
    store.delete(uri)
    store.delete(join(out, "checkpoints", "step-00000003", "COMPLETE.json"))
    with pytest.raises(ConfigError, match="other settings: seed 0 there, 5 now"):
        run(config.model_copy(update={"seed": 5}), store)


@pytest.mark.slow
def test_restart_after_step_stops_as_preempted_then_resumes_and_records_its_timings(tmp_path: Path) -> None:
    """The pilot's restart: a checkpoint at the step, exit 75, the rerun resumes from it (and never stops there
    again), and the drafter manifest records what was measured, the memory plan's prediction beside it."""
    from dflash_shared.errors import Preempted

    store = ObjectStore()
    data = write_tokenized(store, str(tmp_path / "tok"), synthetic_docs(40, max_len=60),
                           identity_of(small_vocab_target()), shards=2)
    out = str(tmp_path / "drafter")
    config = debug(data, out, str(small_vocab_target()), scratch_dir=str(tmp_path / "scratch"), max_steps=4,
                   max_length=64, batch_tokens=128, checkpoint_every=2, restart_after_step=2, log_every=1,
                   mask_token_id=SMALL_MASK_ID, num_anchors=2)
    with pytest.raises(Preempted) as stopped:
        run(config, store)
    assert exit_code_for(stopped.value) == ExitCode.PREEMPTED
    assert not store.exists(join(out, "manifest.json"))
    assert store.exists(join(out, "checkpoints", "step-00000002", "COMPLETE.json"))
    saved = json.loads(store.read_bytes(join(out, "checkpoints", "step-00000002", "trainer_state.json")))
    first = saved["metrics"]["label_agreement_first"]  # step 1's window, logged by the stopped process
    uri = run(config, store)
    section = load_manifest(store, out, Kind.drafter).manifest.section
    assert isinstance(section, DrafterSection) and section.checkpoint_uri.endswith("step-00000004")
    # The resumed process reports the run's first window, not its own.
    assert section.final_metrics["label_agreement_first"] == first
    perf = section.performance
    assert perf["resumed_from_step"] == 2 and perf["resume_seconds"] > 0
    assert perf["checkpoint_save_seconds"] > 0 and perf["step_seconds"] > 0 and perf["tokens_per_s"] > 0
    assert perf["world_size"] == 1 and perf["drafter_parameters"] > 0 and perf["target_parameters"] > 0
    # The plan is an upper bound on what a rank holds (on CPU: the process's peak, torch's accounting).
    assert perf["planned_peak_gib"] > 0 and "peak_memory_gib_max" in perf
    assert run(config, store) == uri


@pytest.mark.slow
def test_a_resume_under_other_settings_is_refused_naming_them(tmp_path: Path) -> None:
    """A checkpoint records the settings that change what a step computes; a resume under another learning rate
    is refused (exit 64) before the checkpoint is loaded, naming lr and both values, while a setting that only
    changes how the run is watched (log_every) may differ."""
    from dflash_shared.errors import Preempted
    from dflash_shared.stage_identity import SettingsChangedError
    from dflash_train.config import settings_identity
    from dflash_train.training.checkpoint import TrainState

    store = ObjectStore()
    data = write_tokenized(store, str(tmp_path / "tok"), synthetic_docs(24, max_len=60),
                           identity_of(small_vocab_target()))
    out = str(tmp_path / "drafter")
    config = debug(data, out, str(small_vocab_target()), scratch_dir=str(tmp_path / "scratch"), max_steps=3,
                   max_length=64, batch_tokens=128, checkpoint_every=2, restart_after_step=2,
                   mask_token_id=SMALL_MASK_ID, num_anchors=2)
    with pytest.raises(Preempted):
        run(config, store)
    checkpoint = join(out, "checkpoints", "step-00000002")
    state = TrainState.model_validate_json(store.read_bytes(join(checkpoint, "trainer_state.json")))
    assert state.identity == settings_identity(config) and state.identity is not None
    assert "lr" in state.identity.settings and "log_every" not in state.identity.settings

    with pytest.raises(SettingsChangedError) as refused:
        run(config.model_copy(update={"lr": 2e-3, "log_every": 5}), store)
    message = str(refused.value)
    assert exit_code_for(refused.value) == ExitCode.USAGE
    assert [d.field for d in refused.value.changed] == ["lr"]
    assert "lr 0.001 there, 0.002 now" in message and "restore this setting" in message
    assert "restart --config RUN.toml --stage train" in message
    assert not store.exists(join(out, "manifest.json"))
