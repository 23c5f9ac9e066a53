"""InfiniBand ports from a sysfs tree shaped like a ConnectX node's, built in a temp dir."""

from __future__ import annotations

from pathlib import Path

from gpuops.agent.infiniband import read_ib
from gpuops.models import EVENT_ADAPTER, IB_MAX_PORTS, IbData


def make_port(
    root: Path,
    device: str,
    port: int = 1,
    state: str = "4: ACTIVE",
    phys: str = "5: LinkUp",
    **counters: int | str,
) -> Path:
    """One port as mlx5 exposes it (values end in a newline, as sysfs files do)."""
    d = root / device / "ports" / str(port)
    (d / "counters").mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    (d / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (d / "link_layer").write_text("InfiniBand\n")
    base: dict[str, int | str] = {
        "symbol_error": 0,
        "link_downed": 0,
        "link_error_recovery": 0,
        "port_rcv_errors": 0,
        "port_xmit_discards": 0,
        "port_rcv_data": 123456789,  # not an error counter: not summed
    }
    for name, value in {**base, **counters}.items():
        (d / "counters" / name).write_text(f"{value}\n")
    return d


def test_a_healthy_node_reports_every_port_active(tmp_path: Path) -> None:
    for i in range(8):
        make_port(tmp_path, f"mlx5_{i}")
    data = read_ib(tmp_path)
    assert data is not None
    ib = IbData.model_validate(data)
    assert (ib.ports, ib.ports_active, ib.ports_down, ib.down_ports) == (8, 8, 0, [])
    assert ib.symbol_error == 0 and ib.detail[0].state == "ACTIVE"
    assert ib.detail[0].phys_state == "LinkUp" and ib.detail[0].rate == "400 Gb/sec (4X NDR)"
    assert "port_rcv_data" not in ib.detail[0].counters


def test_a_down_port_and_counters_are_summed_over_ports(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0", symbol_error=3, link_downed=1)
    make_port(tmp_path, "mlx5_1", state="1: DOWN", phys="2: Polling", symbol_error=12)
    make_port(tmp_path, "mlx5_2", state="2: INIT", phys="5: LinkUp")
    ib = IbData.model_validate(read_ib(tmp_path))
    assert (ib.ports, ib.ports_active, ib.ports_down) == (3, 1, 2)
    assert ib.down_ports == ["mlx5_1/1", "mlx5_2/1"]
    assert (ib.symbol_error, ib.link_downed) == (15, 1)


def test_a_port_disabled_on_purpose_is_not_down(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0")
    make_port(tmp_path, "mlx5_0", port=2, state="1: DOWN", phys="3: Disabled")
    ib = IbData.model_validate(read_ib(tmp_path))
    assert (ib.ports, ib.ports_active, ib.ports_down) == (2, 1, 0)


def test_unreadable_or_garbled_values_are_left_out_not_fatal(tmp_path: Path) -> None:
    port = make_port(tmp_path, "mlx5_0", symbol_error="garbage")
    (port / "counters" / "link_downed").unlink()
    (port / "rate").unlink()
    ib = IbData.model_validate(read_ib(tmp_path))
    assert ib.symbol_error is None and ib.link_downed is None, "no port exposes them: null"
    assert ib.port_rcv_errors == 0 and ib.detail[0].rate == ""


def test_no_infiniband_means_no_event(tmp_path: Path) -> None:
    assert read_ib(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert read_ib(tmp_path / "empty") is None


def test_sizes_are_bounded_and_the_event_validates(tmp_path: Path) -> None:
    for i in range(IB_MAX_PORTS + 6):
        make_port(tmp_path, f"mlx5_{i:03d}")
    data = read_ib(tmp_path)
    assert data is not None and data["ports"] == IB_MAX_PORTS
    event = {
        "id": "1",
        "kind": "ib",
        "node": "n1",
        "ts": "2027-01-15T08:00:00Z",
        "source": "agent",
        "data": data,
    }
    assert EVENT_ADAPTER.validate_python(event).kind == "ib"


def test_the_agent_counts_a_port_down_only_once_it_has_been_up(tmp_path: Path) -> None:
    port = make_port(tmp_path, "mlx5_0")
    make_port(tmp_path, "mlx5_1", state="1: DOWN", phys="2: Polling")  # a spare, never cabled
    seen: set[str] = set()

    first = read_ib(tmp_path, seen)
    assert first is not None and first["ports_down"] == 0, "the spare is not a fault"
    (port / "state").write_text("1: DOWN\n")  # the cabled one loses its link
    (port / "phys_state").write_text("2: Polling\n")
    later = read_ib(tmp_path, seen)

    assert later is not None and later["down_ports"] == ["mlx5_0/1"]
    once = read_ib(tmp_path)
    assert once is not None and once["ports_down"] == 2, "a one-off reading counts every port"
