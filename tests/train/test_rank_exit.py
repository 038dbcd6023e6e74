"""How a rank's failure is classified for its gang (dflash_train.parallel.gang) and the exit status it leaves
its pod."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from dflash_shared.errors import BadInputError, Preempted, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_train.parallel.gang import RANK_EXITS_ENV, PeerLost, classify, rank_exit

GLOO_PEER_GONE = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                              "[127.0.0.1]:28897. This is typically caused by a remote worker crashing.")


def raised(first: BaseException, then: BaseException | None = None) -> BaseException:
    """`first` raised, or `then` raised while handling it (as a failing teardown in a `finally` does)."""
    try:
        try:
            raise first
        finally:
            if then is not None:
                raise then
    except BaseException as exc:  # noqa: B036 - the test's own construction of a chain
        return exc


@pytest.mark.parametrize("failure", [GLOO_PEER_GONE, dist.DistBackendError("NCCL communicator was aborted"),
                                     dist.DistNetworkError("Failed to recv, got 0 bytes"),
                                     dist.DistStoreError("wait timeout")])
def test_a_failed_collective_or_store_is_a_lost_peer(failure: BaseException) -> None:
    final = classify(raised(failure))
    assert isinstance(final, PeerLost) and exit_code_for(final) == ExitCode.PREEMPTED
    assert "a peer rank is gone" in str(final)


def test_own_errors_keep_their_code_even_when_the_teardown_then_fails() -> None:
    bad = BadInputError("shard part-0 does not match the tokenized manifest")
    assert classify(raised(bad, dist.DistBackendError("destroy_process_group failed"))) is bad
    other = RuntimeError("CUDA out of memory")
    assert classify(raised(other)) is other and exit_code_for(other) == ExitCode.RETRYABLE
    stop = Preempted("SIGTERM")
    assert classify(raised(stop)) is stop


def test_each_rank_leaves_its_code_for_the_entrypoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANK_EXITS_ENV, str(tmp_path))
    for rank, failure in (("0", BadInputError("bad shard")), ("1", GLOO_PEER_GONE)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(BaseException) as caught, rank_exit():
            raise failure
        assert exit_code_for(caught.value) == (ExitCode.BAD_INPUT if rank == "0" else ExitCode.PREEMPTED)
    assert (tmp_path / "rank-0").read_text() == "65 bad shard\n"
    assert (tmp_path / "rank-1").read_text().startswith("75 the process group failed, a peer rank is gone")
    # --help and the like leave nothing behind.
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(SystemExit), rank_exit():
        raise SystemExit(0)
    assert not (tmp_path / "rank-2").exists()
