"""The one table of the ports a broker listens on (pipeline/transport/binds.py), and the three start-up
steps that read it: each row is checked for exposure, probed before the start, and listed.

Every row is tried here, so a bind setting added to the config defaults without its row
fails the first test, and one with its row is covered by the others at once."""

from __future__ import annotations

import socket

import pytest
from broker import free_ports

from config import ConfigError, load_settings
from config.defaults import DEFAULTS, SECTIONS
from config.rules import ADDRESS, HTTP_ADDRESS, RULES
from pipeline.process.announce import start_lines
from pipeline.process.preflight import check_ports
from pipeline.transport.binds import BINDS, Bind, bound, host_port
from pipeline.transport.security import EXPOSURE_FIX, check_exposure
from pipeline.transport.topology import client_address


def test_every_bind_setting_of_the_defaults_has_its_row():
    named = {
        f"{s}.{k}" for s in SECTIONS for k in DEFAULTS[s] if k == "bind" or k.endswith("_bind")
    }
    addresses = {key for key, rule in RULES.items() if rule in (ADDRESS, HTTP_ADDRESS)}
    rows = [b.setting for b in BINDS]
    assert len(rows) == len(set(rows))
    assert set(rows) == named | addresses
    for bind in BINDS:
        assert bind.protocol in ("zmq", "http")
        if bind.protocol == "zmq":
            assert RULES[bind.setting] is ADDRESS, bind
        assert bind.switch == "" or RULES[bind.switch].kind == "boolean", bind
        assert bind.guard == "" or bind.guard in RULES, bind
        assert bind.guard in EXPOSURE_FIX, bind  # what to do when it is exposed


def _address(bind: Bind, host: str, port: int) -> str:
    return f"tcp://{host}:{port}" if bind.protocol == "zmq" else f"{host}:{port}"


def _settings(tmp_path, ports: dict[str, str], extra: dict | None = None):
    """Settings with every bind on `ports` (setting -> address) and each switch on."""
    data: dict = {"broker": {"data_dir": str(tmp_path / "data")}}
    for setting, address in ports.items():
        section, key = setting.split(".")
        data.setdefault(section, {})[key] = address
    for bind in BINDS:
        if bind.switch:
            section, key = bind.switch.split(".")
            data.setdefault(section, {})[key] = True
    for section, table in (extra or {}).items():
        data.setdefault(section, {}).update(table)
    return load_settings(None, data)


def _loopback(bind_ports: list[int]) -> dict[str, str]:
    return {b.setting: _address(b, "127.0.0.1", p) for b, p in zip(BINDS, bind_ports, strict=True)}


@pytest.mark.parametrize("bind", BINDS, ids=lambda b: b.setting)
def test_each_bind_beyond_loopback_is_refused_unless_its_guard_is_set(tmp_path, bind):
    ports = _loopback(free_ports(len(BINDS)))
    port = int(ports[bind.setting].rpartition(":")[2])
    ports[bind.setting] = _address(bind, "0.0.0.0", port)
    with pytest.raises(ConfigError) as refused:
        check_exposure(_settings(tmp_path, ports))
    said = str(refused.value)
    assert f"{bind.setting} = '{ports[bind.setting]}'" in said and "allow_insecure" in said
    assert EXPOSURE_FIX[bind.guard] in said
    if bind.guard:  # with its guard set nothing is exposed
        section, key = bind.guard.split(".")
        guards = {section: {key: str(tmp_path / "key")}}
        if bind.guard == "security.server_key":
            guards["security"]["authorized_keys"] = str(tmp_path)
        assert check_exposure(_settings(tmp_path, ports, guards)) == []
    allowed = check_exposure(_settings(tmp_path, ports, {"security": {"allow_insecure": True}}))
    assert len(allowed) == 1 and bind.setting in allowed[0]


@pytest.mark.parametrize("bind", BINDS, ids=lambda b: b.setting)
def test_each_bound_port_in_use_is_refused_naming_the_setting_port_and_fix(tmp_path, bind):
    ports = _loopback(free_ports(len(BINDS)))
    settings = _settings(tmp_path, ports)
    assert [b.setting for b, _ in bound(settings)] == [b.setting for b in BINDS]
    check_ports(settings)  # all free
    port = host_port(ports[bind.setting])[1]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        with pytest.raises(ConfigError) as refused:
            check_ports(settings)
    said = str(refused.value)
    assert said.startswith(f"{bind.setting} = '{ports[bind.setting]}': cannot bind it"), said
    assert "already in use" in said and f"set {bind.setting} to a free port" in said
    assert f"ss -ltnp | grep :{port}" in said


def test_a_bind_that_is_switched_off_is_not_bound_nor_listed(tmp_path):
    ports = _loopback(free_ports(len(BINDS)))
    switched = [b for b in BINDS if b.switch]
    assert switched  # the api
    off = {}
    for bind in switched:
        section, key = bind.switch.split(".")
        off.setdefault(section, {})[key] = False
    settings = _settings(tmp_path, ports, off)
    on = [b.setting for b, _ in bound(settings)]
    assert on == [b.setting for b in BINDS if not b.switch]
    lines = start_lines(settings)
    for bind in switched:
        port = host_port(ports[bind.setting])[1]
        with socket.socket() as holder:  # its port taken: nothing of this broker binds it
            holder.bind(("127.0.0.1", port))
            holder.listen(1)
            check_ports(settings)
        assert not any(f"({bind.setting})" in line for line in lines)


def test_the_banner_lists_every_bound_port_with_what_it_is_for(tmp_path):
    ports = _loopback(free_ports(len(BINDS)))
    lines = start_lines(_settings(tmp_path, ports))
    for bind in BINDS:
        (line,) = [line for line in lines if line.endswith(f"({bind.setting})")]
        assert bind.purpose in line and ports[bind.setting] in line


def test_a_metrics_endpoint_set_to_nothing_is_not_bound(tmp_path):
    ports = _loopback(free_ports(len(BINDS)))
    ports["metrics.bind"] = ""
    assert "metrics.bind" not in [b.setting for b, _ in bound(_settings(tmp_path, ports))]


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("tcp://127.0.0.1:7710", ("127.0.0.1", 7710)),
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("tcp://*:7710", ("*", 7710)),
        ("tcp://[::1]:7710", ("::1", 7710)),
        ("[::1]:8000", ("::1", 8000)),
        ("tcp://broker.example:7710", ("broker.example", 7710)),
        ("ipc:///tmp/fabric-1/front.ipc", None),
        ("tcp://127.0.0.1", None),
        ("127.0.0.1:http", None),
    ],
)
def test_one_reading_of_an_address_for_zmq_and_http(address, expected):
    assert host_port(address) == expected


@pytest.mark.parametrize(
    ("bind", "client"),
    [
        ("tcp://*:7710", "tcp://127.0.0.1:7710"),
        ("tcp://0.0.0.0:7710", "tcp://127.0.0.1:7710"),
        ("tcp://10.1.2.3:7710", "tcp://10.1.2.3:7710"),
        ("ipc:///tmp/fabric-1/front.ipc", "ipc:///tmp/fabric-1/front.ipc"),
    ],
)
def test_a_client_on_this_host_reaches_a_wildcard_bind_on_loopback(bind, client):
    assert client_address(bind) == client
