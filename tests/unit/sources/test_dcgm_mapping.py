"""The DCGM mapping on a dcgm-exporter page of an 8-GPU H200 node, built from NVML readings."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from gpuops.agent.nvml import NvmlBackend
from gpuops.errors import SourceError
from gpuops.models import GpuSample
from gpuops.sources import dcgm
from gpuops.sources.prometheus import parse_exposition, parse_query_answer, promql
from gpuops.sources.readings import (
    Series,
    XidWatch,
    group,
    instance_host,
    telemetry_event,
)

from tests.dcgm_exposition import FIXTURE, exposition, uuid
from tests.fake_pynvml import FakeNvml

NODE = "gpu-node-07"
T = 1_800_000_000.0


def _on(series: list[Series], node: str = NODE) -> dict[str, list[Series]]:
    """Series as the binding hands them on: under their target's node."""
    return {node: series}


def _gpus(text: str, node: str = NODE) -> tuple[dict[int, dict[str, Any]], Counter[str]]:
    dropped: Counter[str] = Counter()
    nodes = group(_on(parse_exposition(text, 100_000, dropped)), "gpu", dropped)
    event = telemetry_event(node, nodes[node], T, dropped)
    assert event is not None
    return {g["index"]: g for g in event["data"]["gpus"]}, dropped


def _series(name: str, value: float, **labels: str) -> Series:
    return Series(name, {"gpu": "0", "Hostname": NODE, **labels}, value)


def test_the_fixture_file_is_the_generated_exposition() -> None:
    assert FIXTURE.read_text() == exposition()


def test_an_8_gpu_page_becomes_one_telemetry_event_with_every_gpu() -> None:
    gpus, dropped = _gpus(exposition())
    assert sorted(gpus) == list(range(8)) and not dropped
    g0 = GpuSample.model_validate(gpus[0])
    assert (g0.uuid, g0.name) == (uuid(0), "NVIDIA H200")
    assert (g0.temp_c, g0.mem_temp_c, g0.temp_slowdown_c, g0.temp_shutdown_c) == (34, 37, 89, 95)
    assert (g0.temp_gpu_max_c, g0.temp_mem_max_c) == (87, 95)
    assert (g0.power_w, g0.power_limit_w, g0.power_default_limit_w) == (112.008, 700, 700)
    assert g0.energy_j == 2230.578  # mJ -> J
    assert g0.mem_used_bytes == 615 * 2**20  # MiB -> bytes
    assert g0.mem_total_bytes == 143_771 * 2**20  # used + free + reserved
    assert g0.clocks_event_reasons == 1 and g0.pcie_replay == 1
    assert g0.remap_pending is False and g0.remap_failure is False
    assert (g0.dram_bw_util, g0.tensor_active, g0.nvlink_rx_bytes_s) == (0, 0, 0)


def test_what_the_exporter_does_not_publish_stays_null() -> None:
    gpus, _ = _gpus(exposition())
    for absent in ("nvlink_links_active", "nvlink_links_down"):
        assert absent not in gpus[0]
    minimal = "\n".join(line for line in exposition().splitlines() if "GPU_TEMP{" in line)
    only, _ = _gpus(minimal + "\n")
    assert set(only[0]) == {"index", "uuid", "name", "temp_c", "labels", "pod", "namespace"} | {
        "container"
    }


def test_kubernetes_labels_and_the_raw_labels_are_kept() -> None:
    gpus, _ = _gpus(exposition())
    assert (gpus[0]["pod"], gpus[0]["namespace"], gpus[0]["container"]) == (
        "llama-pretrain-0",
        "ml-train",
        "trainer",
    )
    assert gpus[5]["pod"] == "bert-finetune-7f9c"
    assert "pod" not in gpus[7] and "namespace" not in gpus[7]  # "" means no pod
    labels = gpus[3]["labels"]
    assert labels["Hostname"] == NODE and labels["DCGM_FI_DRIVER_VERSION"] == "580.159.04"
    assert labels["pci_bus_id"] == "00000000:5D:00.0" and labels["device"] == "nvidia3"


def test_the_mapping_reads_what_the_agent_reads_in_the_same_units() -> None:
    """The same H200 through dcgm-exporter and through NVML: every shared field agrees."""
    agent = NvmlBackend(FakeNvml()).sample()[0][0]
    gpus, _ = _gpus(exposition(gpus=1))
    mine = gpus[0]
    # FB is whole MiB in DCGM, bytes in NVML: compared apart, at MiB resolution.
    skip = {"uuid", "labels", "mem_used_bytes", "mem_total_bytes"}
    shared = (set(agent) & set(mine)) - skip
    assert len(shared) >= 30
    assert {k: mine[k] for k in shared} == {k: agent[k] for k in shared}
    assert mine["mem_total_bytes"] == agent["mem_total_bytes"]
    assert abs(mine["mem_used_bytes"] - agent["mem_used_bytes"]) < 2**20


@pytest.mark.parametrize(
    ("metric", "value", "field", "expected"),
    [
        ("DCGM_FI_PROF_DRAM_ACTIVE", 0.62, "dram_bw_util", 62.0),
        ("DCGM_FI_PROF_SM_ACTIVE", 0.5, "sm_active", 50.0),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.031, "tensor_active", 3.1),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 5_000_000, "energy_j", 5000.0),
        ("DCGM_FI_DEV_FB_USED", 1024, "mem_used_bytes", 2**30),
        ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 0x40, "clocks_event_reasons", 0x40),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", 1, "remap_pending", True),
        ("DCGM_FI_PROF_NVLINK_TX_BYTES", 1.5e10, "nvlink_tx_bytes_s", 1.5e10),
    ],
)
def test_units_are_converted(metric: str, value: float, field: str, expected: object) -> None:
    assert dcgm.convert({metric: value})[field] == expected


def test_fb_total_wins_over_the_sum_and_the_sum_needs_used_and_free() -> None:
    assert dcgm.convert({"DCGM_FI_DEV_FB_TOTAL": 10, "DCGM_FI_DEV_FB_USED": 1})[
        "mem_total_bytes"
    ] == (10 * 2**20)
    assert "mem_total_bytes" not in dcgm.convert({"DCGM_FI_DEV_FB_USED": 1})


def test_nan_and_inf_are_missing_values_never_published() -> None:
    text = exposition(gpus=2, overrides={1: {"DCGM_FI_DEV_GPU_TEMP": float("nan")}})
    gpus, dropped = _gpus(text.replace(" 112.008000\n", " +Inf\n", 1))
    assert "temp_c" not in gpus[1] and gpus[0]["temp_c"] == 34
    assert "power_w" not in gpus[0] and gpus[1]["power_w"] == 112.008
    assert dropped["not_finite"] == 2


def test_per_link_counters_are_summed_and_duplicates_are_not() -> None:
    crc = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
    series = [_series(crc, n, link=str(i)) for i, n in enumerate((1, 2, 4))]
    # The same GPU's series twice (two pods share it): the value is not doubled.
    series += [_series("DCGM_FI_DEV_GPU_TEMP", 50, pod="a"), _series("DCGM_FI_DEV_GPU_TEMP", 50)]
    nodes = group(_on(series), "gpu", Counter())
    assert dcgm.convert(nodes[NODE].gpus[0].flat()) == {"nvlink_crc_errors": 7, "temp_c": 50}


def test_instance_loses_its_port_and_series_of_no_usable_gpu_are_counted() -> None:
    assert instance_host("10.0.0.5:9400") == "10.0.0.5"
    assert instance_host("gpu-node-01.example:9400") == "gpu-node-01.example"
    assert instance_host("[fe80::1]:9400") == "fe80::1" and instance_host("plain") == "plain"
    dropped: Counter[str] = Counter()
    series = [
        Series("DCGM_FI_DEV_GPU_TEMP", {"gpu": "1"}, 40),
        Series("DCGM_FI_DEV_GPU_TEMP", {"gpu": "one", "Hostname": NODE}, 40),
        Series("DCGM_FI_DEV_GPU_TEMP", {"gpu": "0", "Hostname": NODE, "GPU_I_ID": "1"}, 40),
    ]
    nodes = group(_on(series, "gpu-node-02"), "gpu", dropped)
    assert list(nodes) == ["gpu-node-02"] and list(nodes["gpu-node-02"].gpus) == [1]
    assert dropped == Counter({"bad_gpu": 1, "mig_instance": 1})


def test_a_sample_time_no_event_can_carry_is_dropped_not_the_scrape() -> None:
    """Review of issue 30: one exporter line ending in a timestamp past the year 9999 (or
    NaN) made its node's event raise, and the scrape failed for every node. Such a series
    is dropped and counted; the node's other series, and the other nodes, go on."""
    dropped: Counter[str] = Counter()
    temp, power = "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"
    labels = {"gpu": "0", "Hostname": NODE}
    series = [Series(temp, labels, 40, ts) for ts in (1e17, float("nan"), -1.0)]
    series += [Series(power, labels, 300, T)]
    nodes = group(_on(series), "gpu", dropped)
    assert dropped == Counter({"bad_timestamp": 3})
    event = telemetry_event(NODE, nodes[NODE], T + 5, dropped)
    assert event is not None and event["data"]["gpus"][0]["power_w"] == 300
    assert "temp_c" not in event["data"]["gpus"][0]


def test_a_change_of_the_last_xid_is_an_event_but_not_on_the_first_scrape() -> None:
    watch, seen = XidWatch(), []
    for value in (31, 31, 79, 79, 0, 48):
        nodes = group(_on([_series(dcgm.XID_METRIC, value)]), "gpu", Counter())
        seen.append([e["data"]["xid"] for e in watch.events(NODE, nodes[NODE], T)])
    assert seen == [[], [], [79], [], [], [48]]
    nodes = group(_on([_series(dcgm.XID_METRIC, 13)]), "gpu", Counter())
    (event,) = watch.events(NODE, nodes[NODE], T)
    assert (event["kind"], event["source"], event["node"]) == ("xid", "prometheus", NODE)
    assert event["data"]["gpu"] == 0 and event["data"]["labels"]["Hostname"] == NODE
    assert "48 to 13" in event["data"]["message"]


def test_the_exposition_timestamp_is_the_event_time() -> None:
    text = exposition(gpus=1).replace("} 34\n", "} 34 1800000123456\n")
    dropped: Counter[str] = Counter()
    nodes = group(_on(parse_exposition(text, 1000, dropped)), "gpu", dropped)
    event = telemetry_event(NODE, nodes[NODE], T, dropped)
    assert event is not None and event["ts"].startswith("2027-01-15T08:02:03.456")


def test_garbage_is_refused_and_the_series_cap_holds() -> None:
    for bad in ("<html>502 Bad Gateway</html>", 'DCGM_FI_DEV_GPU_TEMP{gpu="0"} warm\n'):
        with pytest.raises(SourceError) as caught:
            parse_exposition(bad, 10, Counter())
        assert caught.value.reason == "garbage"
    over: Counter[str] = Counter()
    everything = len(parse_exposition(exposition(), 100_000, Counter()))
    assert len(parse_exposition(exposition(), 50, over)) == 50
    assert over["over_cap"] == everything - 50 > 0


def test_the_query_asks_for_every_mapped_metric_narrowed_by_the_selector() -> None:
    assert promql().startswith('{__name__=~"DCGM_FI_DEV_GPU_TEMP|') and promql().endswith('"}')
    assert all(name in promql() for name in dcgm.metric_names())
    assert promql('job="dcgm",rack=~"a.*"').endswith('XID_ERRORS",job="dcgm",rack=~"a.*"}')


def test_a_prometheus_query_answer_is_read() -> None:
    body = (
        b'{"status":"success","data":{"resultType":"vector","result":['
        b'{"metric":{"__name__":"DCGM_FI_DEV_GPU_TEMP","gpu":"2","Hostname":"n1",'
        b'"instance":"10.0.0.1:9400","job":"dcgm"},"value":[1800000000.5,"71"]},'
        b'{"metric":{"__name__":"up","instance":"x"},"value":[1800000000.5,"1"]},'
        b'{"metric":{"__name__":"DCGM_FI_DEV_POWER_USAGE","gpu":"2","Hostname":"n1"},'
        b'"value":[1800000000.5,"NaN"]}]}}'
    )
    series = parse_query_answer(body, 10, Counter())
    assert [(s.name, s.labels.get("job"), s.ts) for s in series] == [
        ("DCGM_FI_DEV_GPU_TEMP", "dcgm", None),
        ("DCGM_FI_DEV_POWER_USAGE", None, None),
    ]
    assert series[0].value == 71 and series[1].value != series[1].value  # NaN
    for bad in (b"{}", b'{"status":"error","error":"bad query"}', b"not json"):
        with pytest.raises(SourceError, match="not a query answer"):
            parse_query_answer(bad, 10, Counter())


def test_labels_beyond_what_a_sample_holds_are_cut() -> None:
    many = {f"l{i:03d}": "x" * 5000 for i in range(100)}
    nodes = group(_on([_series("DCGM_FI_DEV_GPU_TEMP", 40, **many)]), "gpu", Counter())
    event = telemetry_event(NODE, nodes[NODE], T, Counter())
    assert event is not None
    labels = event["data"]["gpus"][0]["labels"]
    assert len(labels) == 64 and max(len(v) for v in labels.values()) == 1024


def test_docs_show_the_mapping_table_and_a_counters_csv_with_every_field() -> None:
    docs = (Path(__file__).resolve().parents[3] / "docs" / "sources.md").read_text()
    assert dcgm.markdown_table() in docs
    csv = docs.split("```csv\n", 1)[1].split("```", 1)[0]
    listed = {line.split(",")[0] for line in csv.splitlines() if not line.startswith("#")}
    wanted = set(dcgm.metric_names()) - {
        "DCGM_FI_DEV_FB_TOTAL",  # used + free + reserved give it
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",  # an alternative of POWER_MGMT_LIMIT
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",  # the old name of CLOCKS_EVENT_REASONS
    }
    assert listed == wanted
