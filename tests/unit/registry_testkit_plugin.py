"""`--import registry_testkit_plugin`: registers the test candidates of registry_testkit into the default
registry (and the axpy tuner), for CLI tests run in a subprocess."""
import registry_testkit as kit

from rtckern.registry import default_registry

reg = default_registry()
for cls in kit.ALL:
    reg.register(cls(), replace=True)
reg.register_request_builder(kit.OP, kit.build_axpy_request, replace=True,
                             help="shape: n; --opt aligned=0/1", example="--dtype bf16 --shape 1048576")
kit.register_tuner()
