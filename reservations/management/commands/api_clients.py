"""``python manage.py api_clients ACTION``: API clients and their tokens from a shell, for the
scripts that provision them (docs/API.md, "Clients, tokens and scopes"). What the admin's
API clients and API tokens pages do:

- ``create NAME``: a client and its first token;
- ``list``: every client with its tokens' prefixes (``--json`` for scripts);
- ``rotate NAME``: a new token, the others revoked (``--revoke-others``) or left valid until
  ``revoke`` ends their grace period;
- ``revoke NAME --token PREFIX`` or ``--all``;
- ``deactivate NAME`` / ``activate NAME``: every token refused, or accepted again.

A new token is printed once, alone on stdout (``TOKEN=$(python manage.py api_clients create
…)``); what happened goes to stderr. Only the token's digest is stored
(``reservations.clients.issue_token``). Each change gets an entry in the admin's history,
under the Django user named by ``--by`` (reservations.commands.history_user_id), never the
token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import IntegrityError, transaction

from reservations import admin_guard, clients
from reservations.commands import HelpFormatter, ProjectCommand, history_user_id, os_user
from reservations.models import ApiClient, ApiToken, Offering

COMMAND = "api_clients"
NAME_MAX_LENGTH = ApiClient._meta.get_field("name").max_length or 100
DEFAULT_RATE = 600  # ApiClient.requests_per_minute's default
MAX_RATE = 2**31 - 1  # the column is a PostgreSQL integer
MAX_ID = 2**63 - 1
SCOPES = ("read", "write")
NEVER = "never"


def _when(moment: datetime | None) -> str | None:
    return moment.astimezone(UTC).isoformat(timespec="seconds") if moment else None


def _shown(moment: datetime | None, absent: str) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if moment else absent


def _scopes(client: ApiClient) -> list[str]:
    return [s for s, on in zip(SCOPES, (client.can_read, client.can_write), strict=True) if on]


def _parse_scopes(text: str) -> tuple[bool, bool]:
    wanted = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(wanted - set(SCOPES))
    if unknown:
        named = ", ".join(map(repr, unknown))
        raise CommandError(f"--scopes: unknown scope {named}; give read, write or read,write")
    if not wanted:
        raise CommandError("--scopes must not be empty; give read, write or read,write")
    return "read" in wanted, "write" in wanted


def _clean_name(raw: str) -> str:
    name = raw.strip()
    if not name:
        raise CommandError("NAME must not be blank")
    if len(name) > NAME_MAX_LENGTH:
        raise CommandError(f"NAME must be at most {NAME_MAX_LENGTH} characters")
    if "\x00" in name:
        raise CommandError("NAME must not contain NUL")
    return name


def _client(name: str) -> ApiClient:
    found = ApiClient.objects.filter(name=name.strip()).first()
    if found is None:
        raise CommandError(
            f"no API client named {name.strip()!r}; `manage.py {COMMAND} list` shows them"
        )
    return found


def _offerings(ids: Iterable[int]) -> list[Offering]:
    wanted = sorted(set(ids))
    found = Offering.objects.in_bulk([i for i in wanted if 0 < i <= MAX_ID])
    missing = [i for i in wanted if i not in found]
    if missing:
        raise CommandError(
            f"no offering with id {', '.join(map(str, missing))}: check the ids (the admin's "
            "Offerings list shows them); no client was created"
        )
    return [found[i] for i in wanted]


def _by_argument(parser: CommandParser) -> None:
    parser.add_argument(
        "--by",
        default=os_user(),
        metavar="NAME",
        help="who is acting, recorded in the admin's history",
    )


def _history(by: str, objects_by_result: dict[str, list[Any]], action: str) -> None:
    admin_guard.log_rows(
        history_user_id(by), objects_by_result, f"{COMMAND} {action} (manage.py, by {by})"
    )


class Command(ProjectCommand):
    help = (
        "Create, list, rotate, revoke and (de)activate API clients and their tokens. A new "
        "token is printed once, alone on stdout; `api_clients ACTION --help` shows an action's "
        "options."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(
            dest="action",
            required=True,
            title="actions",
            metavar="ACTION",
            help="what to do (required)",
        )

        def action(name: str, text: str) -> CommandParser:
            sub: CommandParser = actions.add_parser(
                name, help=text, description=text, formatter_class=HelpFormatter
            )
            return sub

        create = action(
            "create", "Create a client and print its first token, alone on stdout (shown once)."
        )
        create.add_argument("name", metavar="NAME", help="the client's name, unique (required)")
        create.add_argument(
            "--scopes",
            default="read",
            help="read (GET), write (POST: hold, renew, confirm, cancel) or read,write",
        )
        offerings = create.add_mutually_exclusive_group(required=True)
        offerings.add_argument(
            "--all-offerings", action="store_true", help="the client may use every offering"
        )
        offerings.add_argument(
            "--offering",
            type=int,
            action="append",
            metavar="ID",
            dest="offering_ids",
            help="an offering the client may use; repeat for more (no default: give "
            "--offering or --all-offerings)",
        )
        create.add_argument(
            "--requests-per-minute",
            type=int,
            default=DEFAULT_RATE,
            metavar="N",
            help="requests answered per minute; beyond it, 429 with Retry-After",
        )
        _by_argument(create)

        listing = action("list", "List every client, its scopes, offerings, rate and tokens.")
        listing.add_argument(
            "--json",
            action="store_true",
            help="a JSON array for scripts instead of the table (prefixes only, never a token "
            "or digest)",
        )

        rotate = action(
            "rotate",
            "Issue a new token for a client and print it, alone on stdout (shown once). Its "
            "other tokens stay valid unless --revoke-others: end their grace period later "
            "with revoke.",
        )
        rotate.add_argument("name", metavar="NAME", help="the client's name (required)")
        rotate.add_argument(
            "--revoke-others",
            action="store_true",
            help="revoke the client's other tokens at once, in the same transaction",
        )
        _by_argument(rotate)

        revoke = action(
            "revoke", "Revoke one token of a client, or all of them; refused from the next request."
        )
        revoke.add_argument("name", metavar="NAME", help="the client's name (required)")
        which = revoke.add_mutually_exclusive_group(required=True)
        which.add_argument(
            "--token",
            metavar="PREFIX",
            help="the token's prefix as list shows it, or the whole token (no default: give "
            "--token or --all)",
        )
        which.add_argument("--all", action="store_true", help="every token of the client")
        _by_argument(revoke)

        for name, text in (
            ("deactivate", "Deactivate a client: every one of its tokens is refused."),
            ("activate", "Activate a client again: its unrevoked tokens are accepted again."),
        ):
            switch = action(name, text)
            switch.add_argument("name", metavar="NAME", help="the client's name (required)")
            _by_argument(switch)

    def handle(self, *args: Any, **options: Any) -> None:
        handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "create": self.create,
            "list": self.listing,
            "rotate": self.rotate,
            "revoke": self.revoke,
            "deactivate": lambda o: self.switch(o, active=False),
            "activate": lambda o: self.switch(o, active=True),
        }
        handlers[options["action"]](options)

    def note(self, text: str) -> None:
        # stdout carries only a new token, so that a script can capture it; the rest is for
        # the person at the terminal. Unstyled: it is not an error.
        self.stderr.write(text, style_func=lambda line: line)

    # --- actions ---------------------------------------------------------------------------

    def create(self, options: dict[str, Any]) -> None:
        name = _clean_name(options["name"])
        can_read, can_write = _parse_scopes(options["scopes"])
        rate = options["requests_per_minute"]
        if not 1 <= rate <= MAX_RATE:
            raise CommandError(f"--requests-per-minute must be between 1 and {MAX_RATE}")
        offerings = _offerings(options["offering_ids"] or [])
        try:
            with transaction.atomic():
                client = ApiClient.objects.create(
                    name=name,
                    can_read=can_read,
                    can_write=can_write,
                    all_offerings=options["all_offerings"],
                    requests_per_minute=rate,
                )
                client.offerings.set(offerings)
                token = clients.issue_token(client)
                prefix = token[: clients.SHOWN_PREFIX_LENGTH]
                _history(options["by"], {f"created, token {prefix}": [client]}, "create")
        except IntegrityError:
            # The name is unique: its index, not a prior read, refuses a duplicate, so two
            # scripts creating the same client at once get one client and one clear error.
            if ApiClient.objects.filter(name=name).exists():
                raise CommandError(
                    f"an API client named {name!r} exists already: choose another name, or give "
                    f"it a new token with `manage.py {COMMAND} rotate {name}`"
                ) from None
            raise
        where = "every offering" if client.all_offerings else f"offerings {_ids(offerings)}"
        self.stdout.write(token)
        self.note(
            f"created API client {name!r} ({','.join(_scopes(client))}; {where}; {rate} "
            f"requests/min); its token {prefix}… is on stdout, shown only this once"
        )

    def listing(self, options: dict[str, Any]) -> None:
        found = list(ApiClient.objects.order_by("name").prefetch_related("offerings", "tokens"))
        if options["json"]:
            self.stdout.write(json.dumps([_as_json(client) for client in found], indent=2))
        elif found:
            self.stdout.write(_table(found))
        else:
            self.stdout.write("no API clients")

    def rotate(self, options: dict[str, Any]) -> None:
        client = _client(options["name"])
        with transaction.atomic():
            others = list(client.tokens.filter(revoked_at__isnull=True).order_by("pk"))
            token = clients.issue_token(client)
            prefix = token[: clients.SHOWN_PREFIX_LENGTH]
            history: dict[str, list[Any]] = {f"issued token {prefix}": [client]}
            if options["revoke_others"]:
                clients.revoke_tokens(others)
                history["revoked"] = others
            _history(options["by"], history, "rotate")
        self.stdout.write(token)
        shown = ", ".join(t.prefix for t in others) or "none"
        if options["revoke_others"]:
            after = f"revoked its other token(s): {shown}"
        elif others:
            after = (
                f"its other token(s) stay valid: {shown}; once callers use the new one, revoke "
                f"each with `manage.py {COMMAND} revoke {client.name} --token PREFIX`"
            )
        else:
            after = "it had no other valid token"
        self.note(
            f"new token {prefix}… of {client.name!r} is on stdout, shown only this once; {after}"
        )

    def revoke(self, options: dict[str, Any]) -> None:
        client = _client(options["name"])
        tokens = client.tokens.order_by("pk")
        given = (options["token"] or "").strip().removesuffix("…")
        if given:
            if len(given) > clients.SHOWN_PREFIX_LENGTH:
                tokens = tokens.filter(digest=clients.digest(given))
            else:
                tokens = tokens.filter(prefix=given)
            chosen = list(tokens)
            if not chosen:
                raise CommandError(
                    f"{client.name!r} has no token {given[: clients.SHOWN_PREFIX_LENGTH]}…; "
                    f"`manage.py {COMMAND} list` shows its tokens' prefixes"
                )
            if len(chosen) > 1:
                raise CommandError(
                    f"{len(chosen)} tokens of {client.name!r} begin {given}: give the whole "
                    f"token, or revoke them all with --all"
                )
        else:
            chosen = list(tokens)
        with transaction.atomic():
            valid = [t for t in chosen if t.revoked_at is None]
            clients.revoke_tokens(valid)
            _history(options["by"], {"revoked": valid}, "revoke")
        already = len(chosen) - len(valid)
        self.stdout.write(
            f"revoked {len(valid)} token(s) of {client.name!r}"
            + (f": {', '.join(t.prefix for t in valid)}" if valid else "")
            + (f"; {already} already revoked" if already else "")
        )

    def switch(self, options: dict[str, Any], *, active: bool) -> None:
        client = _client(options["name"])
        verb = "activated" if active else "deactivated"
        if client.is_active == active:
            self.stdout.write(f"{client.name!r} is already {verb}; nothing changed")
            return
        with transaction.atomic():
            ApiClient.objects.filter(pk=client.pk).update(is_active=active)
            _history(options["by"], {verb: [client]}, "activate" if active else "deactivate")
        effect = (
            "its unrevoked tokens are accepted again"
            if active
            else "every one of its tokens is refused"
        )
        self.stdout.write(f"{verb} {client.name!r}: {effect}")


def _ids(offerings: Iterable[Offering]) -> str:
    return ", ".join(str(o.pk) for o in offerings) or "none"


def _tokens(client: ApiClient) -> list[ApiToken]:
    return sorted(client.tokens.all(), key=lambda t: t.pk)  # prefetched: sorted here


def _offering_ids(client: ApiClient) -> list[int]:
    return sorted(o.pk for o in client.offerings.all())


def _as_json(client: ApiClient) -> dict[str, Any]:
    return {
        "name": client.name,
        "scopes": _scopes(client),
        "all_offerings": client.all_offerings,
        "offerings": _offering_ids(client),
        "requests_per_minute": client.requests_per_minute,
        "active": client.is_active,
        "created_at": _when(client.created_at),
        "tokens": [
            {
                "prefix": t.prefix,
                "created_at": _when(t.created_at),
                "last_used_at": _when(t.last_used_at),
                "revoked_at": _when(t.revoked_at),
            }
            for t in _tokens(client)
        ],
    }


def _table(found: list[ApiClient]) -> str:
    """One line a client, then one indented line a token."""
    header = ("NAME", "SCOPES", "OFFERINGS", "RATE/MIN", "ACTIVE")
    cells = [
        (
            client.name,
            ",".join(_scopes(client)) or "none",
            "all" if client.all_offerings else ",".join(map(str, _offering_ids(client))) or "none",
            str(client.requests_per_minute),
            "yes" if client.is_active else "no",
        )
        for client in found
    ]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    out = [line(header)]
    for client, values in zip(found, cells, strict=True):
        out.append(line(values))
        out.extend(
            f"  token {t.prefix}  created {_shown(t.created_at, '?')}"
            f"  last used {_shown(t.last_used_at, NEVER)}  revoked {_shown(t.revoked_at, 'no')}"
            for t in _tokens(client)
        )
        if not client.tokens.all():
            out.append("  no tokens")
    return "\n".join(out)
