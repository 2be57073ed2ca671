# The set-up every device session shares; source it from the repository root
# (`. benchmarks/device/setup.sh`): installs the wheels in .whl/ (msgspec, posix-ipc,
# pytest-asyncio ...) into /tmp/site without touching the system, links the folders that
# install under other import names, points Python and the kernel cache there, and defines
# build_kernels (the CUDA kernels, built before anything is timed).
mkdir -p /tmp/site
# Installed once per set of wheels (a stamp lists them): parts of a run that start side by
# side (run_eval_parts.sh) must not reinstall into /tmp/site while another part imports.
if compgen -G ".whl/*.whl" >/dev/null && [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$(ls .whl/*.whl)" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && ls .whl/*.whl >/tmp/site/.wheels
fi
# Without an install, the folders that install under other import names need links.
ln -sfn "$PWD/ipc" /tmp/site/lmpool_ipc
ln -sfn "$PWD/kernels" /tmp/site/lmpool_kernels
ln -sfn "$PWD/tools" /tmp/site/lmpool_tools
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 LMPOOL_KERNEL_CACHE=/tmp/lmpool-kernels
# Builds the engine's and the transfer's CUDA kernels into the kernel cache (once per cache
# key), so no timed run pays for a compile. Returns non-zero when the build fails.
build_kernels() {
  timeout 300 python3 -c "from lmpool.ops.cuda import load_extension as a; from lmpool.dataplane.block_copy import load_extension as b; a(); b()"
}
# Console scripts of the wheels (the smg gateway's, for the smg_cache_aware peer) land here.
export PATH=/tmp/site/bin:$PATH
