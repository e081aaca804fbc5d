"""Model identities, recipes, lanes and routes over fake or fixture stages."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dgr_session.identity import CertificationStatus, EvidenceClass, Lane, ModelIdentity, Recipe
from dgr_session.route import Route, StageSpec


def fixture_identity(n_layer: int) -> ModelIdentity:
    """Model identity of the fake model with ``n_layer`` layers."""
    digest = hashlib.blake2b(f"dgr-fake-model/{n_layer}".encode(), digest_size=32).digest()
    return ModelIdentity(content_hash=digest, arch="fake", n_layer=n_layer)


def fixture_recipe(context: int = 4096) -> Recipe:
    """Recipe of the fake model."""
    return Recipe(quant_types=("F32",), context=context, kv_type="f32")


def fixture_lane(certified: bool = True) -> Lane:
    """A CPU lane, certified with fixture evidence (or dark)."""
    return Lane(
        backend="cpu",
        llama_cpp_commit="0" * 40,
        patch_stack_hash=b"\x00" * 8,
        dgr_version="0.1.0",
        hardware="fake",
        certification=CertificationStatus.CERTIFIED if certified else CertificationStatus.DARK,
        evidence=EvidenceClass.FIXTURE if certified else None,
    )


def make_route(
    endpoints: Sequence[str],
    cuts: Sequence[int],
    *,
    identity: ModelIdentity,
    recipe: Recipe | None = None,
    lane: Lane | None = None,
    width: int = 16,
) -> Route:
    """A route over ``endpoints`` split at the interior layer indices ``cuts``."""
    bounds = [0, *cuts, identity.n_layer]
    if len(endpoints) != len(bounds) - 1:
        raise ValueError(f"{len(cuts)} cuts need {len(bounds) - 1} endpoints, got {len(endpoints)}")
    last = len(endpoints) - 1
    return Route(
        StageSpec(
            endpoint=endpoint,
            layer_begin=bounds[i],
            layer_end=bounds[i + 1],
            identity=identity,
            recipe=recipe if recipe is not None else fixture_recipe(),
            lane=lane if lane is not None else fixture_lane(),
            boundary_in=0 if i == 0 else width,
            boundary_out=0 if i == last else width,
        )
        for i, endpoint in enumerate(endpoints)
    )
