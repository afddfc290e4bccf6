"""A kit kernel that fails to lower or compile on the device, as one line.

The kernels are Triton programs that only a GPU's compiler sees in full: Pallas lowers a
kernel to Triton's IR when the step is lowered for a GPU, and XLA:GPU compiles that IR
when the step compiles. Either can refuse it (a block shape, an operation Triton does not
take, too much shared memory). `failure_line` turns such an error into one line naming
the kernel, the error's first line and the flag that turns the kernel off;
`run.cli.main_guard` prints it and exits with code 2 instead of a traceback.

Which kernel failed, from the most precise evidence to the least:
1. the note `dispatch` adds to an error raised while a kernel is traced;
2. the kernel's name where Pallas's lowering holds it (the frames of an unfiltered
   traceback: `pallas_call`'s `debug_info` / `name_and_src_info`);
3. the kernel's name in the error's text (XLA:GPU names the custom call it compiles);
4. an error that names Pallas or its Triton custom call but no kernel: "a Pallas kernel",
   with both flags.
"""
from __future__ import annotations

import traceback

# Each kernel's `pallas_call` name, and the flag that asks for it.
KERNEL_FLAGS = {
    "gelu_fc2_forward": "--mlp-kernels",
    "gelu_fc2_backward": "--mlp-kernels",
    "gelu_fc2_weight_gradient": "--mlp-kernels",
    "qkv_projection": "--qkv-projection",
    "qkv_input_gradient": "--qkv-projection",
}
NOTE = "in the kit's Pallas kernel "  # + the kernel's name: added by `dispatch`
_PALLAS_WORDS = ("pallas", "__gpu$xla.gpu.triton")


def _chain(error: BaseException):
    """The error, its causes and contexts, each once."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _names_in_frames(error: BaseException):
    """Strings Pallas's lowering holds as the kernel's name, in the traceback's frames."""
    tb = error.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if "pallas" in tb.tb_frame.f_code.co_filename:
            debug = local.get("debug_info")
            params = local.get("params") if isinstance(local.get("params"), dict) else {}
            named = params.get("name_and_src_info")
            for value in (local.get("name"), getattr(debug, "func_name", None),
                          getattr(named, "name", None)):
                if isinstance(value, str):
                    yield value
        tb = tb.tb_next


def failed_kernel(error: BaseException) -> str | None:
    """The kit kernel `error` came from (a key of KERNEL_FLAGS), "" for a Pallas kernel
    that cannot be told apart, None for an error that is not a Pallas kernel's."""
    chain = _chain(error)
    for e in chain:  # 1
        for note in getattr(e, "__notes__", ()):
            if note.startswith(NOTE) and note[len(NOTE):] in KERNEL_FLAGS:
                return note[len(NOTE):]
    for e in chain:  # 2
        for name in _names_in_frames(e):
            if name in KERNEL_FLAGS:
                return name
    text = "".join(traceback.format_exception_only(type(error), error)) + "".join(
        str(e) for e in chain)
    found = [name for name in KERNEL_FLAGS if name in text]  # 3
    if found:
        return max(found, key=len)  # "qkv_projection" is no part of another name
    return "" if any(word in text.lower() for word in _PALLAS_WORDS) else None  # 4


def failure_line(error: BaseException) -> str | None:
    """One line for a kit kernel's failure to lower or compile, or None (`failed_kernel`)."""
    name = failed_kernel(error)
    if name is None:
        return None
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    what = f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__
    if name:
        flag = KERNEL_FLAGS[name]
        return (f"the Pallas kernel {name} ({flag} pallas) failed to lower or compile on this "
                f"device: {what}; {flag} xla turns it off")
    return (f"a Pallas kernel failed to lower or compile on this device: {what}; "
            f"--mlp-kernels xla and --qkv-projection xla turn them off")
