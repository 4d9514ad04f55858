"""`modelyard doctor`: what this machine offers modelyard and what stops it from using it.

It asks a running server (`GET /admin/doctor`: every engine, for the GPUs it owns) and, when
none answers at `--url` (or with `--local`), gathers the same report in this process for the
whole machine — and says which. `--summary` is the few lines `make run` prints before serving
(it leaves out torch's import, which takes seconds); `--json` the report as the API serves it.
The exit status is 1 when a problem is an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from modelyard import __version__
from modelyard.cli.server_url import MODELYARD_DEFAULT, auth_headers, default_url
from modelyard.config import Settings, load_settings
from modelyard.wire.doctor import DoctorReport, EngineDoctor, LlamaServer, Problem, Torch

__all__ = ["doctor", "local_report", "render", "summary_lines"]

SERVER_TIMEOUT_S = 180.0  # engines import torch in a child process to answer
_MARK = {"error": "[red]✗ error[/red]", "warning": "[yellow]! warning[/yellow]",
         "info": "[blue]· note[/blue]"}


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**3:.1f} GiB"


def local_report(settings: Settings, *, quick: bool = False) -> DoctorReport:
    """The report gathered in this process (no server): one `local` part for the machine."""
    from modelyard.engine.doctor import gather, simulated_gpus
    from modelyard.front.ops.doctor import disks, host_facts
    from modelyard.wire.doctor import assemble

    part = gather(settings, "local", simulated=simulated_gpus(settings), quick=quick)
    return assemble(__version__, "local", [part], host_facts(), disks(settings))


def ask_server(url: str) -> tuple[DoctorReport | None, str]:
    """The server's report, or None and why there is none."""
    try:
        r = httpx.get(url.rstrip("/") + "/admin/doctor", headers=auth_headers(),
                      timeout=httpx.Timeout(SERVER_TIMEOUT_S, connect=2.0))
    except httpx.HTTPError as exc:
        return None, f"no server at {url} ({type(exc).__name__})"
    if r.status_code != 200:
        return None, f"the server at {url} answered {r.status_code} to GET /admin/doctor"
    try:
        return DoctorReport.model_validate(r.json()), f"asked the server at {url}"
    except ValueError as exc:
        return None, f"the server at {url} sent no doctor report ({exc})"


# ---- rendering ---------------------------------------------------------------------------------


def _llama_devices(ls: LlamaServer) -> str:
    if not ls.found:
        return "not found"
    if ls.devices is None:
        return "unknown (--list-devices failed)"
    gpus = ls.gpu_devices or ()
    return ", ".join(f"{d.name} ({d.description})" for d in gpus) or "no GPU (CPU build)"


def _torch(t: Torch) -> str:
    if not t.installed:
        return "not installed"
    build = f"CUDA {t.cuda}" if t.cuda else "CPU build"
    out = f"{t.version} ({build})"
    if t.error:
        return f"{out}; does not import: {t.error}"
    if t.cuda_available is not None:
        out += (f"; opens {t.device_count} GPU(s)" + (f": {', '.join(t.devices)}" if t.devices
                                                      else "")
                if t.cuda_available else "; CUDA not available")
    if t.warning:
        out += f"; warned: {t.warning}"
    return out


def _engine(e: EngineDoctor) -> Group:
    title = Text.from_markup(f"[bold]{escape(e.engine)}[/bold]"
                             + (" [magenta](simulated GPUs)[/magenta]" if e.simulated else "")
                             + (" [dim](devices: cpu)[/dim]" if e.cpu_only else ""))
    if not e.up:
        return Group(title, Text(f"  did not answer: {e.error}", style="red"))
    rows = Table.grid(padding=(0, 2))
    rows.add_column(style="dim")
    rows.add_column()
    driver = (f"{e.driver.version} (via {e.driver.source})" if e.driver.version
              else "simulated" if e.simulated else "none")
    rows.add_row("driver", driver)
    nvml = e.nvml.per_process + (f" — {e.nvml.detail}" if e.nvml.detail else "")
    if e.nvml.bindings_version and e.nvml.bindings_version != "given":
        nvml = f"nvidia-ml-py {e.nvml.bindings_version}; per-process: {nvml}"
    rows.add_row("NVML", nvml)
    ls = e.llama_server
    rows.add_row("llama-server", f"{ls.path or '-'}" + (f" ({ls.version})" if ls.version else ""))
    rows.add_row("  its devices", _llama_devices(ls))
    rows.add_row("torch", _torch(e.torch))
    rows.add_row("vLLM", e.vllm.version if e.vllm.installed else "not installed")
    parts: list[Any] = [title, rows]
    if e.gpus:
        gpus = Table("GPU", "NAME", "FREE / TOTAL", "CC", "TEMP", box=None, padding=(0, 2))
        for g in e.gpus:
            gpus.add_row(str(g.index), g.name, f"{_gib(g.free_bytes)} / {_gib(g.total_bytes)}",
                         g.compute_capability or "-",
                         f"{g.temperature_c} °C" if g.temperature_c is not None else "-")
        parts.append(gpus)
    else:
        parts.append(Text("  no GPU", style="dim"))
    return Group(*parts)


def _problems(problems: Iterable[Problem]) -> list[str]:
    lines = []
    for p in problems:
        who = f" [dim]({', '.join(p.engines)})[/dim]" if len(p.engines) > 1 else ""
        lines.append(f"{_MARK[p.severity]} {escape(p.message)}{who}")
        lines.append(f"    fix: {escape(p.fix)}")
    return lines


def render(report: DoctorReport, where: str) -> Group:
    host = report.host
    head = Text.from_markup(
        f"[bold]modelyard doctor[/bold] {report.version} — {escape(where)}\n"
        f"host: {host.cpus} CPUs, RAM {_gib(host.ram_available_bytes)} available of "
        f"{_gib(host.ram_total_bytes)}")
    disks = Table(Column("DISK", no_wrap=True), Column("PATH", overflow="fold"),
                  Column("FREE / TOTAL", no_wrap=True), box=None,
                  padding=(0, 2))
    for d in report.disks:
        disks.add_row(d.what, d.path, f"{_gib(d.free_bytes)} / {_gib(d.total_bytes)}")
    problems = _problems(report.problems) or ["[green]no problem found[/green]"]
    return Group(head, disks, *(_engine(e) for e in report.engines),
                 Text.from_markup("[bold]problems[/bold]"),
                 *(Text.from_markup(line) for line in problems))


def summary_lines(report: DoctorReport) -> list[str]:
    """A few lines (rich markup): the GPUs and what each backend makes of them, then each error
    and warning with its fix."""
    gpus = [g for e in report.engines for g in e.gpus]
    first = report.engines[0] if report.engines else None
    if not gpus:
        machine = "no GPU"
    else:
        names = sorted({g.name for g in gpus})
        caps = sorted({g.compute_capability for g in gpus if g.compute_capability})
        machine = (f"{len(gpus)} GPU(s): {', '.join(names)}"
                   + (f", cc {'/'.join(caps)}" if caps else "")
                   + (f", driver {first.driver.version}" if first and first.driver.version
                      else ""))
    parts = [machine]
    if first is not None and first.up:
        parts.append(f"llama-server: {_llama_devices(first.llama_server)}")
        t = first.torch
        parts.append("torch: " + (f"{t.version} ({'CUDA ' + t.cuda if t.cuda else 'CPU'})"
                                  if t.installed else "none"))
        parts.append("vLLM: " + ((first.vllm.version or "yes") if first.vllm.installed
                                  else "no"))
    free = min((d.free_bytes for d in report.disks), default=None)
    parts.append(f"disk {_gib(free)} free, RAM {_gib(report.host.ram_available_bytes)} free")
    lines = ["doctor: " + escape("; ".join(parts))]
    for p in report.problems:
        if p.severity != "info":
            lines.append(f"doctor: {_MARK[p.severity]} {escape(p.message)}")
            lines.append(f"doctor:     fix: {escape(p.fix)}")
    notes = sum(p.severity == "info" for p in report.problems)
    if notes:
        lines.append(f"doctor: {notes} note(s): `modelyard doctor` shows them")
    return lines


# ---- the command -------------------------------------------------------------------------------


def doctor(
    url: Annotated[
        str, typer.Option("--url", envvar="MODELYARD_URL",
                          help="The server to ask (else $OLLAMA_HOST, else "
                          f"{MODELYARD_DEFAULT}); none answering: gather here.")
    ] = default_url(),
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="YAML config file (local gathering).")
    ] = None,
    local: Annotated[
        bool, typer.Option("--local", help="Gather in this process; do not ask a server.")
    ] = False,
    simulate_gpus: Annotated[
        str | None, typer.Option(help="Report simulated GPUs, e.g. 2x24GiB (implies --local).")
    ] = None,
    summary: Annotated[
        bool, typer.Option("--summary", help="A few lines (no torch import): what `make run` "
                           "prints.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
) -> None:
    """Check the NVIDIA driver and GPUs, NVML, llama-server's and torch's builds and the devices
    they can open, vLLM, disk and RAM; each problem comes with its fix."""
    console = Console(highlight=False)
    report: DoctorReport | None = None
    why = f"asked no server ({'--local' if local else '--simulate-gpus'})"
    if not local and simulate_gpus is None:
        report, why = ask_server(url)
    if report is None:
        try:
            settings = load_settings(config, simulate_gpus=simulate_gpus)
        except (FileNotFoundError, ValueError) as exc:
            Console(stderr=True).print(f"[red]config error:[/red] {escape(str(exc))}")
            raise typer.Exit(2) from exc
        report = local_report(settings, quick=summary)
        why = f"{why}: gathered in this process"
    if as_json:
        console.print_json(report.model_dump_json())
    elif summary:
        for line in summary_lines(report):
            console.print(line, soft_wrap=True)
    else:
        console.print(render(report, why))
    if report.worst == "error":
        raise typer.Exit(1)
