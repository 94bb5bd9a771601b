"""`python run.py keys new NAME [--dir DIR]`: a CURVE key pair, and how to use and authorize
it (docs/operations.md)."""

from __future__ import annotations

import argparse

from pipeline.core import exitcodes


def add_parser(commands) -> None:
    keys = commands.add_parser("keys", help="CURVE key pairs for the broker and its clients")
    key_actions = keys.add_subparsers(dest="action", required=True)
    new = key_actions.add_parser("new", help="write NAME.key (public) and NAME.key_secret")
    new.add_argument("name", help="a name for the pair: letters, digits, '.', '_', '-'")
    new.add_argument("--dir", default="var/keys", help="where to write the pair")
    new.set_defaults(handler=keys_command)


def keys_command(args: argparse.Namespace) -> int:
    """`keys new NAME [--dir DIR]`: a CURVE key pair, and how to use and authorize it."""
    from pathlib import Path

    from pipeline.transport.security import new_key_pair

    public, secret = new_key_pair(args.name, Path(args.dir))
    print(f"public key: {public}")
    print(f"secret key: {secret} (mode 0600: keep it on the host that uses it)")
    print(
        f"authorize it on a broker: copy {public} into the broker's security.authorized_keys "
        f"directory (new connections see it at once; no restart)"
    )
    print(
        f"use it as a client: --key {secret} --server-key BROKER.key, or security.client_key = "
        f'"{secret}" and security.server_public_key in the config'
    )
    print(f'use it as the broker\'s own key: security.server_key = "{secret}"')
    return exitcodes.OK
