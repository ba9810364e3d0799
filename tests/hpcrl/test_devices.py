"""The device of a worker from Ray's id and the visible-device variables: NVIDIA and AMD, Ray
setting the list per actor (NOSET off) or leaving the node's (NOSET on)."""

from __future__ import annotations

import pytest

from hpcrl.devices import DeviceError, node_visible_env, worker_device

NV_NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
AMD_NOSET = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}


def lists(value: str) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": value, "HIP_VISIBLE_DEVICES": value}


@pytest.mark.parametrize("environ, ray_id, index, visible", [
    # NOSET off: Ray wrote CUDA_VISIBLE_DEVICES=<id>; the process sees one GPU, index 0, and an
    # inherited LOCAL_RANK is overwritten
    ({"CUDA_VISIBLE_DEVICES": "5", "LOCAL_RANK": "3"}, "5", 0, "5"),
    # NOSET on: the node's list stays, the index is the id's position in it
    ({**NV_NOSET, "CUDA_VISIBLE_DEVICES": "2,3,5,6", "LOCAL_RANK": "0"}, "5", 2, "2,3,5,6"),
    # NOSET on without a list: Ray's ids are the physical indexes
    (NV_NOSET, "6", 6, None),
])
def test_nvidia(environ: dict[str, str], ray_id: str, index: int, visible: str | None) -> None:
    dev = worker_device(environ, [ray_id], "nvidia")
    assert dev.ray_id == ray_id and dev.index == index
    assert dev.env == {"LOCAL_RANK": str(index), **(lists(visible) if visible else {})}


@pytest.mark.parametrize("environ, ray_id, index, visible", [
    # NOSET off: Ray wrote HIP_=<id>; the CUDA_ inherited from the node (0..7) would make vLLM's
    # ROCm platform refuse the pair: it becomes HIP's; ROCR_ (the node's filter) is left alone
    ({"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
      "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, "3", 0, "3"),
    # NOSET on (what the seeds' script sets): the node's HIP_ list stays, CUDA_ follows it
    ({**AMD_NOSET, "HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
      "LOCAL_RANK": "0"}, "6", 6, "0,1,2,3,4,5,6,7"),
    ({**AMD_NOSET, "HIP_VISIBLE_DEVICES": "4,5,6,7", "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
     "5", 1, "4,5,6,7"),
    # NOSET on, only CUDA_ on the node (HIP honours it)
    ({**AMD_NOSET, "CUDA_VISIBLE_DEVICES": "1,3"}, "3", 1, "1,3"),
    (AMD_NOSET, "2", 2, None),
    # the NVIDIA switch does not stop Ray on AMD
    ({**NV_NOSET, "HIP_VISIBLE_DEVICES": "7", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, "7", 0, "7"),
])
def test_amd(environ: dict[str, str], ray_id: str, index: int, visible: str | None) -> None:
    dev = worker_device(environ, [ray_id], "amd")
    assert dev.index == index
    assert dev.env == {"LOCAL_RANK": str(index), **(lists(visible) if visible else {})}
    assert "ROCR_VISIBLE_DEVICES" not in dev.env


def test_an_id_missing_from_the_kept_list_is_refused() -> None:
    with pytest.raises(DeviceError, match=r"GPU 5, which `CUDA_VISIBLE_DEVICES=0,1`.*unset "
                                          r"`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`"):
        worker_device({**NV_NOSET, "CUDA_VISIBLE_DEVICES": "0,1"}, ["5"], "nvidia")
    with pytest.raises(DeviceError, match="`HIP_VISIBLE_DEVICES=0,1`"):
        worker_device({**AMD_NOSET, "HIP_VISIBLE_DEVICES": "0,1"}, ["4"], "amd")


@pytest.mark.parametrize("ids", [[], ["0", "1"]])
def test_a_worker_takes_exactly_one_gpu(ids: list[str]) -> None:
    with pytest.raises(DeviceError, match=f"gave this worker {len(ids)} GPU ids.*exactly one"):
        worker_device({}, ids, "nvidia")


def test_node_lists_agree() -> None:
    assert node_visible_env({}, ["2", "3"]) == lists("2,3")
    assert node_visible_env({}, []) == {}
    assert node_visible_env({"CUDA_VISIBLE_DEVICES": []}, []) == lists("")
    assert node_visible_env({"ROCR_VISIBLE_DEVICES": ["4", "6"]}, ["4", "6"]) == {
        "ROCR_VISIBLE_DEVICES": "4,6", **lists("0,1")}
    with pytest.raises(DeviceError, match="name different devices"):
        node_visible_env({"HIP_VISIBLE_DEVICES": ["0"], "CUDA_VISIBLE_DEVICES": ["1"]}, [])
