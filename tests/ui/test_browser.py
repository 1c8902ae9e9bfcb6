"""The two UIs in a real browser, walked as a user walks them: log in to the Prefect UI, trigger the pipeline
from its deployment's form, follow the run to Completed and read its summary artifact; then log in to the
MLflow UI as the read-only viewer and find the run with its stage runs, a PPO curve and the evaluation report.
Both servers run with authentication on, as the production stack does.

Headless Chromium (Debian's, through Playwright) against a real `prefect server` + process worker and an
`mlflow server` on 127.0.0.1 (the fixtures of tests/flows/test_production.py). Screenshots of each step go to
$ALIGNFLOW_UI_SCREENSHOTS or tests/ui/screenshots/ (the folder is printed); docs/images/ holds two of them for
the README. Selectors are what a user sees (roles, labels, descriptions, titles); where a widget has no
accessible name (the run table's expander, Plotly's points) the DOM class is used and said so.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from alignflow.config import PPOConfig, SFTConfig
from tests.conftest import small_config
from tests.flows.test_production import MLFLOW_VIEWER, PREFECT_AUTH_STRING, _deploy, _http

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: `.venv/bin/pip install -e '.[dev]'`")
expect = playwright_api.expect
# The UIs load their lists by API calls after the page: on a 2-core box that has just run the pipeline, the
# MLflow runs table has taken over playwright's 5 s default to appear.
expect.set_options(timeout=30_000)

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """$ALIGNFLOW_CHROMIUM, else the first Chromium on PATH (Debian's package installs /usr/bin/chromium)."""
    explicit = os.environ.get("ALIGNFLOW_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="no Chromium found: `apt-get install -y chromium` (Debian) "
        "or set ALIGNFLOW_CHROMIUM to its binary; these tests never download a browser",
    ),
]

STAGES = ["data", "base", "sft", "reward", "engine", "ppo", "evaluate"]
# The deployment's defaults; the form changes two of them before the run.
DEPLOYED_ITERATIONS, FORM_ITERATIONS = 4, 3
FORM_SFT_LR = "0.002"
# The shrunken pipeline takes a few minutes on a quiet 2-core machine and can take twice that with other
# jobs on it, so the wait is 15 min: a run still going then is a fault, not a slow machine.
RUN_TIMEOUT_MS = 900_000

# One property of Prefect's schema form: the nearest enclosing `.schema-form-property`; its own input is the
# one directly in its body (a nested section's inputs are deeper).
FORM_PROPERTY = (
    "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')][1]"
)
OWN_INPUT = "xpath=./div[contains(@class, 'p-label__body')]/fieldset/div/input"


def form_input(page, section_description: str, label: str):
    """The input of field `label` inside the form section shown with `section_description` (the config model's
    docstring: several sections have fields of the same name, e.g. `Lr` in sft, reward, ppo, dpo)."""
    section = page.get_by_text(section_description, exact=True).locator(FORM_PROPERTY)
    return section.get_by_text(label, exact=True).locator(FORM_PROPERTY).locator(OWN_INPUT)


def shoot(page, folder, name: str, locator=None) -> None:
    (locator or page).screenshot(path=str(folder / name))


def log_in_to_prefect(page, ui: str, folder) -> None:
    """The Prefect UI's login form: a wrong auth string is refused where it was typed, the right one opens the
    page that was asked for."""
    page.goto(f"{ui}/deployments")
    expect(page).to_have_url(re.compile(r"/login\?redirect="))
    auth_field = page.get_by_placeholder("admin:pass")
    auth_field.fill(PREFECT_AUTH_STRING.split(":", 1)[0] + ":not-the-password")
    page.get_by_role("button", name="Login", exact=True).click()
    expect(page.get_by_text("Authentication failed.").first).to_be_visible()
    expect(page).to_have_url(re.compile(r"/login\?redirect="))
    shoot(page, folder, "00-prefect-login-refused.png")
    auth_field.fill(PREFECT_AUTH_STRING)
    page.get_by_role("button", name="Login", exact=True).click()
    expect(page).to_have_url(re.compile(r"/deployments$"))


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium: the system's, driven through `executable_path` (no browser download)."""
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser, screenshots_dir, request, mlflow_server):
    """A fresh page; when the test fails, its last view is saved as <test name>-failure.png. It answers the
    MLflow server's login prompt (HTTP Basic) as the viewer, as a browser with a saved login does; the Prefect
    UI has its own login form, which the test fills."""
    context = browser.new_context(
        viewport={"width": 1400, "height": 1000},
        http_credentials={
            "username": MLFLOW_VIEWER[0], "password": MLFLOW_VIEWER[1], "origin": mlflow_server[0]
        },
    )
    context.set_default_timeout(30_000)
    page = context.new_page()
    yield page
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        page.screenshot(path=str(screenshots_dir / f"{request.node.name}-failure.png"), full_page=True)
    context.close()


@pytest.fixture(scope="module")
def deployment(mlflow_server, prefect_server, tmp_path_factory):
    """The pipeline deployed to the Prefect server, tracking to the MLflow server, outputs on the local S3
    server (the production layout; MLflow's registry refuses a local folder as a model version's source)."""
    mlflow_url, s3_endpoint = mlflow_server
    api, env = prefect_server
    work = tmp_path_factory.mktemp("ui-pipeline")
    config = small_config(
        work / "work",
        stages=STAGES,
        deployment={"name": "browser"},
        storage={"root": "s3://prod/ui-test", "endpoint_url": s3_endpoint},
        tracking={"uri": mlflow_url, "experiment": "browser"},
        sft={"epochs": 1},
        engine={"max_seq_len": 96, "max_batch_size": 32},
        ppo={
            "iterations": DEPLOYED_ITERATIONS,
            "prompts_per_iteration": 8,
            "minibatch_size": 8,
            "max_new_tokens": 16,
            "checkpoint_every": 2,
        },
        evaluate={"n_prompts": 8, "max_new_tokens": 16, "temperature": 1.0},
    )
    ids = _deploy(config.model_dump(mode="json"), work / "pipeline.yaml", env)
    return {
        "id": ids["alignflow-pipeline/browser"],
        "api": api,
        "ui": api.removesuffix("/api"),
        "mlflow": mlflow_url,
    }


@pytest.mark.timeout(RUN_TIMEOUT_MS // 1000 + 300)  # above the suite's 600 s: the run alone may take 15 min
@pytest.mark.heavy
def test_run_from_prefect_ui_then_inspect_in_mlflow_ui(deployment, page, browser, screenshots_dir):
    started = time.time()
    ui, shots = deployment["ui"], screenshots_dir

    # --- Prefect: log in; the deployment's page -> Run -> Custom run -> change two fields -> Submit
    log_in_to_prefect(page, ui, shots)
    page.goto(f"{ui}/deployments/deployment/{deployment['id']}")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Custom run", exact=True).click()
    sft_lr = form_input(page, SFTConfig.model_json_schema()["description"], "Lr (Optional)")
    iterations = form_input(page, PPOConfig.model_json_schema()["description"], "Iterations (Optional)")
    expect(iterations).to_have_value(str(DEPLOYED_ITERATIONS))  # the form starts from the deployed config
    sft_lr.fill(FORM_SFT_LR)
    iterations.fill(str(FORM_ITERATIONS))
    sft_lr.scroll_into_view_if_needed()
    shoot(page, shots, "01-prefect-custom-run-form.png")
    page.get_by_role("button", name="Submit", exact=True).click()

    # The confirmation toast names the new run and links to it. Prefect 3.8 shows the toast twice, the second
    # over the first while they slide in: the visible one is the last.
    toast = page.locator(".toast-flow-run-create__message").first
    expect(toast).to_contain_text("scheduled to start now")
    run_name = toast.locator(".toast-flow-run-create__message--emphasized").first.inner_text()
    run_page = re.compile(r"/runs/flow-run/[0-9a-f-]{36}")
    page.get_by_role("button", name="View run").last.click()
    try:
        page.wait_for_url(run_page, timeout=5000)
    except playwright_api.TimeoutError:
        # The click can meet the toast's second copy sliding in and go nowhere (the page stays on the
        # deployment's Runs tab): there a user opens the run by its name, as here.
        page.get_by_role("link", name=run_name, exact=True).first.click()
    expect(page).to_have_url(run_page)
    expect(page.get_by_text(run_name, exact=True).first).to_be_visible()
    run_id = page.url.rsplit("/", 1)[-1].split("?")[0]
    run = _http("GET", f"{deployment['api']}/flow_runs/{run_id}")
    config = run["parameters"]["config"]
    assert (config["sft"]["lr"], config["ppo"]["iterations"]) == (float(FORM_SFT_LR), FORM_ITERATIONS), (
        "the values typed into the form are the run's parameters"
    )

    # --- Prefect: follow the run page (it refreshes itself) until the state badge is final
    badge = page.locator(".state-badge").first
    expect(badge).to_have_text(re.compile("Completed|Failed|Crashed|Cancelled"), timeout=RUN_TIMEOUT_MS)
    final = _http("GET", f"{deployment['api']}/flow_runs/{run_id}")
    assert badge.inner_text().strip() == "Completed", (
        f"flow run ended {final['state_type']}: {final['state']}"
    )
    shoot(page, shots, "02-prefect-flow-run-completed.png")

    # The run page's Artifacts tab lists the stage table, the MLflow link and the evaluation summary; the
    # table opens on its artifact page: one ok row per stage. (The tabs are <li> without role=tab.)
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    cards = page.locator(".artifact-card")
    for key in ["alignflow-summary", "alignflow-mlflow", "alignflow-evaluation", "alignflow-promotion"]:
        expect(cards.filter(has_text=key)).to_have_count(1)
    shoot(page, shots, "03-prefect-flow-run-artifacts.png")
    cards.filter(has_text="alignflow-summary").click()
    table = page.get_by_role("table")
    expect(table).to_be_visible()
    for stage in ["data", "base", "sft", "reward-rm", "engine", "ppo", "evaluate"]:
        expect(
            table.get_by_role("row").filter(has=page.get_by_role("cell", name=stage, exact=True))
        ).to_contain_text("ok")
    shoot(page, shots, "04-prefect-summary-artifact.png")

    # --- MLflow: a browser without the login gets the server's 401; this one logs in as the viewer.
    mlflow = deployment["mlflow"]
    stranger = browser.new_context()
    try:
        # Chromium turns the server's Basic challenge, with no login to answer it, into a navigation error.
        with pytest.raises(playwright_api.Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
            stranger.new_page().goto(mlflow)
        assert stranger.request.get(mlflow).status == 401
    finally:
        stranger.close()
    # Home -> the workspace -> Model training -> the experiment -> the parent run, expanded into its stage
    # runs. With workspaces on (the stack's MLflow), home lists them first; the pipeline writes to `default`.
    page.goto(mlflow)
    page.get_by_role("link", name="default", exact=True).click()
    page.get_by_text("Model training", exact=True).first.click()
    page.get_by_role("link", name="browser", exact=True).first.click()
    parent = page.get_by_role("link", name=re.compile(r"^test-\d{8}-\d{6}$"))
    expect(parent).to_have_count(1)
    assistant_close = page.get_by_role("button", name="Close")
    if assistant_close.count() == 1:  # MLflow 3's assistant panel takes a third of the width
        assistant_close.click()
    # The row's expander has no accessible name: it is the only button in the run-name cell.
    parent.locator("xpath=ancestor::*[@role='gridcell'][1]").get_by_role("button").click()
    stage_links = {}
    for name in ["data", "base", "sft", "reward-rm", "engine", "ppo", "evaluate"]:
        link = page.get_by_role("link", name=name, exact=True)
        expect(link).to_be_visible()
        stage_links[name] = link.get_attribute("href")
    shoot(page, shots, "05-mlflow-parent-and-stage-runs.png")

    # The parent run's parameters are the resolved config, with the value typed into Prefect's form.
    parent.click()
    expect(
        page.get_by_role("row").filter(has=page.get_by_role("cell", name="sft.lr", exact=True))
    ).to_contain_text(FORM_SFT_LR)

    # A PPO curve: one point per iteration that ran (the form asked for 3).
    page.goto(f"{mlflow}/{stage_links['ppo']}")
    page.get_by_role("tab", name="Model metrics").click()
    page.get_by_placeholder("Search metric charts").fill("policy_loss")
    chart = page.get_by_test_id("experiment-view-compare-runs-card").filter(
        has=page.get_by_title("losses/policy_loss", exact=True)
    )
    expect(chart).to_be_visible()
    expect(chart.locator("path.point")).to_have_count(FORM_ITERATIONS)  # Plotly's markers: no accessible name
    shoot(page, shots, "06-mlflow-ppo-policy-loss.png")

    # The evaluation report artifact, rendered.
    page.goto(f"{mlflow}/{stage_links['evaluate']}")
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("eval_report.md", exact=True).first.click()
    expect(page.get_by_role("heading", name="Evaluation: final policy vs SFT")).to_be_visible()
    expect(page.get_by_text(f"ppo policy after {FORM_ITERATIONS} iterations")).to_be_visible()
    shoot(page, shots, "07-mlflow-eval-report.png")
    print(
        f"browser test: {time.time() - started:.0f} s from the deployment page to the report; "
        f"screenshots in {shots}"
    )
