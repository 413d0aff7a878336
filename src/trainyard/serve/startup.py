"""What the service resolves and checks once, when bento/service.py is imported (in the
`bentoml serve` or `bentoml build` process itself, before any worker starts): the model
and its provenance, the shadow, the prediction log's folder, the drift reference and
whether it follows a registry alias. A missing or altered model, an unknown registry
model or alias, or a 'cuda' that cannot be had stops the command with its message
instead of leaving workers failing and respawning behind an unready port.

Registry models need MLflow, which this layer never imports: the caller hands in a loader
of its ``ModelRegistry`` (trainyard.core.model_ref), called only when a model source is a
registry URI; it answers None where MLflow is absent (a bento, which serves the files it
was built with).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainyard.core.config import ServeParams
from trainyard.core.errors import TrainyardError
from trainyard.core.host import x86_without_vnni
from trainyard.core.model_ref import ModelRef, ModelRegistry, parse_model_ref, registered_version
from trainyard.runtime.model_file import CARD_SUFFIXES
from trainyard.runtime.sessions import choose_providers
from trainyard.serve.batch_choice import ServePath, choose_path
from trainyard.serve.drift_watch import reference_beside
from trainyard.serve.log_and_shadow import build_observer
from trainyard.serve.predictor import Predictor
from trainyard.serve.refused import overloaded
from trainyard.serve.settings import (
    Settings,
    at_precision,
    log_folder,
    model_provenance,
    read_settings,
    resolve_model,
    resolve_shadow,
    shadow_source,
    trace_headers,
    verify_model,
)
from trainyard.serve.swap import (
    Follow,
    ModelWatcher,
    TraceHeaders,
    follow_plan,
    swap_into,
    watch_if_following,
)

log = logging.getLogger("bentoml.serve.trainyard")

# The registry (MLflow's, trainyard.track.model_refs), or None where it cannot be had.
RegistryLoader = Callable[[], ModelRegistry | None]


@dataclass
class Startup:
    """The service's resolved start: what every worker builds its predictor from."""

    settings: Settings
    model_path: Path
    provenance: dict[str, str]
    shadow: tuple[Path, dict[str, str]] | None
    log_dir: Path | None
    reference: Path | None
    follow: Follow | None
    trace: TraceHeaders  # the headers of the model answering now (a swap changes them)
    registry: ModelRegistry | None
    path: ServePath | None = None  # how /classify runs the model, and why (None: a thread)

    @property
    def params(self) -> ServeParams:
        return self.settings.params

    def predictor(self) -> Predictor:
        """This worker's predictor with its observer (log, shadow, drift score)."""
        predictor = Predictor.load(self.model_path, self.params, self.provenance)
        predictor.inline_images = 0 if self.path is None else self.path.inline_images
        predictor.observer = build_observer(
            self.params,
            predictor.card,
            reference_key(predictor),
            self.log_dir,
            self.shadow,
            self.reference,
            self.settings.drift,
        )
        return predictor

    def startup_line(self, predictor: Predictor) -> str:
        follow = follow_plan(self.settings.model_ref, self.params.reload_s, self.follow)
        message = predictor.startup_message(self.settings.params_file)
        if self.path is None:
            return f"{message}; {follow}"
        return f"{message}; /classify runs {self.path.describe()} ({self.path.why}); {follow}"

    def carry_observer(self, old: Predictor, new: Predictor) -> None:
        """A swap keeps the prediction log, the shadow and how /classify runs the model;
        the drift score restarts against the new version's reference."""
        new.observer = old.observer
        new.inline_images = old.inline_images  # the alias's next version: the same pipeline's
        name, number = new.provenance["registry_model"], new.provenance["registry_version"]
        self.fetch_card(registered_version(name, number, "serve.model"))  # its GET /card
        if new.observer is not None:
            reference = self.fetch_reference(registered_version(name, number, "serve.model"))
            new.observer.model_changed(reference_key(new), reference, self.settings.drift)

    def watch(self, service: Any, pages: Any) -> ModelWatcher[Predictor] | None:
        """Serving models:/NAME@ALIAS: a started watcher that swaps each version the alias
        moves to into ``service`` and ``pages`` (trainyard.serve.swap); else None."""
        swap = swap_into(service, pages, self.trace, self.carry_observer)
        ref, provenance = self.settings.model_ref, self.provenance
        return watch_if_following(ref, self.params, provenance, self.follow, swap)

    def guard_options(self) -> dict[str, Any]:
        """The request guard's arguments (trainyard.serve.guard): the key, the limits, the
        trace headers, and with batching the route whose shed 503 becomes ours."""
        p = self.params
        return {
            "api_key": self.settings.api_key,
            "max_body_bytes": p.max_body_bytes,
            "trace_headers": self.trace,
            "max_header_bytes": p.max_header_bytes,
            "body_timeout_s": p.body_timeout_s,
            "header_timeout_s": p.header_timeout_s,
            "shed_paths": frozenset({"/classify"} if p.batching else ()),
            "shed": lambda: overloaded(p.max_latency_ms).response(),
        }

    def fetch_card(self, ref: ModelRef) -> None:
        """A registered version's model card, beside its downloaded model where GET /card
        reads it; a version without one (or no MLflow) is said once and /card says so."""
        if self.registry is None:
            return
        try:
            for kind in CARD_SUFFIXES:
                self.registry.fetch_card(ref, self.settings.cache_dir, kind)
        except TrainyardError as err:
            log.info("trainyard: %s: no model card for GET /card (%s)", ref, err)

    def fetch_reference(self, ref: ModelRef) -> Path | None:
        """The reference evaluate stored with a registered version; None without MLflow or
        for a version registered before references existed (said once)."""
        if self.registry is None:
            return None
        try:
            return self.registry.fetch_reference(ref, self.settings.cache_dir)
        except TrainyardError as err:
            log.info("trainyard: %s: no reference (%s)", ref, err)
            return None


def start(load_registry: RegistryLoader) -> Startup:
    """Resolve and check everything the workers need (see the module's docstring)."""
    settings = read_settings()
    # The registry (MLflow) is loaded only for a registry model: a local one needs none.
    # Without it, a registry source is a ModelError saying to build from a model file.
    registry = load_registry() if needs_registry(settings) else None
    fp32_path, source = resolve_model(settings, registry)
    # serve.precision int8: the int8 file beside it / registered with it (ModelError if none).
    model_path = at_precision(settings, fp32_path, source, registry)
    if settings.params.precision == "int8" and x86_without_vnni():
        log.warning(
            "trainyard: serving an int8 model on an x86 CPU without VNNI: ONNX Runtime's "
            "uint8 x int8 kernels may saturate here and answer other than at export; check "
            "it on the test set on this machine, or serve.precision: fp32"
        )
    sha256 = verify_model(model_path)
    choose_providers(settings.params.device)
    path = choose_path(settings.params, model_path, sha256)
    settings = replace(settings, params=path.params)
    provenance = model_provenance(model_path, source)
    shadow = resolve_shadow(settings, registry)
    if shadow is not None:
        verify_model(shadow[0])
    follow = following(settings, registry) if registry and settings.from_registry else None
    begun = Startup(
        settings=settings,
        model_path=model_path,
        provenance=provenance,
        shadow=shadow,
        log_dir=log_folder(settings),
        reference=None,
        follow=follow,
        trace=TraceHeaders(trace_headers(sha256, provenance)),
        registry=registry,
        path=path,
    )
    if settings.from_registry:
        begun.fetch_card(settings.model_ref)
    # What the model saw on its test split (evaluate's model.reference.npz): drift score.
    begun.reference = (
        begun.fetch_reference(settings.model_ref)
        if settings.from_registry
        else reference_beside(fp32_path)  # an int8 model's is its fp32 model's
    )
    return begun


def needs_registry(settings: Settings) -> bool:
    """Whether the served model or its shadow is a registry model (a ModelError naming the
    field when either is no model reference)."""
    if settings.from_registry:
        return True
    shadow = shadow_source(settings)
    if shadow is None:
        return False
    return parse_model_ref(shadow, "serve.shadow", settings.params_file.parent).from_registry


def following(settings: Settings, registry: ModelRegistry) -> Follow:
    """The alias watcher's look: the version the alias moved to, at serve.precision (a
    version without its int8 file raises: the answering model stays, the next look retries)."""
    ref, cache = settings.model_ref, settings.cache_dir

    def moved(current: str) -> tuple[Path, dict[str, str]] | None:
        found = registry.follow(ref, current, cache)
        if found is None:
            return None
        return at_precision(settings, found.path, found.provenance, registry), found.provenance

    return moved


def reference_key(predictor: Predictor) -> str:
    """The sha256 a drift reference must name for ``predictor``'s model: an int8 model is
    compared with its fp32 model's reference (evaluate scores the fp32 model; int8 agrees
    with it on >= export.int8_min_agreement of the test set)."""
    return predictor.model.metadata.get("quantized_from_sha256") or predictor.sha256
