"""`python run.py fleet --ray ADDRESS --config FILE`: workers as Ray actors, as many as the
broker's demand asks for, per `[[fleet]]` table (assembly/ray_fleet.py; docs/scaling.md, "Ray").

`--list` prints the fleet's actors as JSON and `--down` drains and removes them all; without
either it runs the controller until SIGTERM or Ctrl-C, and leaves the actors running (a
controller started again adopts them)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from cli.common import curve, key_options
from config import load_settings
from pipeline.core import exitcodes
from pipeline.core.errors import ConfigError

INSTALL = "pip install -e '.[ray]'"


def add_parser(commands) -> None:
    fleet = commands.add_parser("fleet", help="workers as a Ray fleet sized by the broker's demand")
    fleet.add_argument("--ray", required=True, help="the Ray cluster: HOST:PORT, ray://..., auto")
    fleet.add_argument("--config", required=True, help="TOML settings with [[fleet]] tables")
    fleet.add_argument(
        "--broker", help="dispatch address the actors connect to (default: the config's)"
    )
    fleet.add_argument("--heartbeat", help="heartbeat address (default: the broker's port + 1)")
    fleet.add_argument(
        "--namespace", default="inference-fabric", help="Ray namespace of the fleet's actors"
    )
    fleet.add_argument(
        "--scale-down-s",
        type=float,
        default=30.0,
        help="drain actors once fewer have been needed this long",
    )
    fleet.add_argument("--interval-s", type=float, default=1.0, help="seconds between turns")
    what = fleet.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="print the fleet's actors as JSON")
    what.add_argument("--down", action="store_true", help="drain and remove every actor")
    key_options(fleet)
    fleet.set_defaults(handler=fleet_command)


def fleet_command(args: argparse.Namespace) -> int:
    from pipeline.process.stage import StopFlags
    from pipeline.transport.topology import client_address

    try:
        from assembly.ray_fleet import FleetControl, Target
    except ImportError as exc:
        print(f"error: run.py fleet needs Ray ({exc}); install it: {INSTALL}", file=sys.stderr)
        return exitcodes.FAILED
    settings = load_settings(args.config)
    if not settings.fleet and not (args.list or args.down):
        raise ConfigError(
            f"{args.config}: has no [[fleet]] table; add one per model, e.g. [[fleet]] "
            'model = "minilm", max = 4, num_gpus = 1 (docs/scaling.md, "Ray")'
        )
    for value, flag in ((args.scale_down_s, "--scale-down-s"), (args.interval_s, "--interval-s")):
        if value < 0 or (flag == "--interval-s" and value == 0):
            print(f"error: {flag} {value:g} must be > 0 seconds", file=sys.stderr)
            return exitcodes.USAGE
    broker = args.broker or client_address(settings.dispatch.bind)
    heartbeat = args.heartbeat
    if heartbeat is None:
        heartbeat = (
            _next_port(broker) if args.broker else client_address(settings.dispatch.heartbeat_bind)
        )
    target = Target(broker, heartbeat, curve(args))
    control = FleetControl(settings, target, args.namespace, args.scale_down_s, args.interval_s)
    logging.getLogger("fabric").setLevel(logging.INFO)
    control.connect(args.ray)
    if args.list:
        print(json.dumps(control.actors(), indent=2))
        return exitcodes.OK
    if args.down:
        return control.down()
    stopper = StopFlags()
    return control.run(lambda: stopper.stop)


def _next_port(broker: str) -> str | None:
    """tcp://host:P -> tcp://host:P+1, the heartbeat beside dispatch (as `run.py worker`)."""
    if not broker.startswith("tcp://"):
        return None
    host, _, port = broker.rpartition(":")
    return f"{host}:{int(port) + 1}"
