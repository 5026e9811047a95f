"""The runbook page each alert's runbook_url links to: staff only, one section per alert of
deploy/alerts.yml at the anchor the link names, and the file's text never becomes markup."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import yaml
from django.test import Client
from django.urls import reverse

from cleanup.operations.console.runbook import anchor, render
from tests.support import ROOT
from tests.support.staff import login_staff


def _alert_links() -> dict[str, str]:
    groups = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"]
    return {r["alert"]: r["annotations"]["runbook_url"] for g in groups for r in g["rules"]}


@pytest.fixture
def staff_client(db: None) -> Client:
    return login_staff("oncall")


def test_every_alerts_runbook_link_opens_its_section_with_checks_and_fix(
    staff_client: Client,
) -> None:
    for alert, url in _alert_links().items():
        link = urlsplit(url)
        # given the link of a firing alert, when the on-call opens it
        page = staff_client.get(link.path)
        # then the section the fragment names is there, with its checks and its fix
        assert page.status_code == 200, alert
        html = page.content.decode()
        assert f'<h2 id="{link.fragment}">{alert}</h2>' in html, alert
        section = html.split(f'id="{link.fragment}"', 1)[1].split("<h2", 1)[0]
        assert "<strong>First three checks</strong>" in section, alert
        assert "<strong>Fix</strong>" in section, alert
        assert "<code>kubectl" in section and "<code>docker compose" in section, alert


def test_the_runbook_is_for_staff_only(db: None) -> None:
    page = Client().get(reverse("cleanup-runbook"))
    assert page.status_code == 302
    assert page["Location"].startswith(reverse("admin:login"))


def test_the_health_page_links_to_the_runbook(staff_client: Client) -> None:
    page = staff_client.get(reverse("cleanup-health") + "?workers=0")
    assert f'href="{reverse("cleanup-runbook")}" id="runbook-link"' in page.content.decode()


def test_text_of_the_file_never_becomes_markup() -> None:
    html, sections = render(
        "## Alert & <b>x</b>\n\nA `<script>alert(1)</script>` and **<i>bold</i>**.\n\n- a <a>\n"
    )
    assert "<script>" not in html and "<b>" not in html and "<a>" not in html
    assert "<code>&lt;script&gt;alert(1)&lt;/script&gt;</code>" in html
    assert "<strong>&lt;i&gt;bold&lt;/i&gt;</strong>" in html
    assert [s.title for s in sections] == ["Alert & <b>x</b>"]
    assert '<h2 id="alert--bxb">Alert &amp; &lt;b&gt;x&lt;/b&gt;</h2>' in html


def test_anchors_are_the_ones_a_repository_rendering_gives() -> None:
    assert anchor("ReservationCleanupSLOBreach") == "reservationcleanupslobreach"
    assert anchor("Dead-letter triage: the why") == "dead-letter-triage-the-why"
