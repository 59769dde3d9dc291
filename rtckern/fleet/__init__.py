"""Getting kernel caches onto many machines: manifests (and record mode), manifest prefill, bundles.

    from rtckern.fleet import load_manifest, load_preset, replay, export_bundle, import_bundle

See docs/fleet.md for how the pieces fit: bundles per toolchain x arch, read-only layers, the Redis tier.
"""

from .bundle import BundleError, Limits, bundle_bytes, export_bundle, import_bundle, select_entries, verify_bundle
from .manifest import ManifestEntry, ManifestError, load_manifest, load_preset, parse_lines, preset_names
from .plan import PlannedRequest, plan
from .record import record_request, request_line
from .replay import ReplayResult, replay, summarize

__all__ = ["BundleError", "Limits", "ManifestEntry", "ManifestError", "PlannedRequest", "ReplayResult",
           "bundle_bytes", "export_bundle", "import_bundle", "load_manifest", "load_preset", "parse_lines", "plan",
           "preset_names", "record_request", "replay", "request_line", "select_entries", "summarize",
           "verify_bundle"]
