# The set-up every device session shares; source it from the repository root
# (`. benchmarks/device/setup.sh`): installs the wheels in .whl/ (msgspec, posix-ipc,
# pytest-asyncio ...) and, when carried, Dynamo's in .whl-dynamo/ into /tmp/site without
# touching the system, links the folders that install under other import names, points Python
# and the kernel cache there, and defines build_kernels (the CUDA kernels, built before anything
# is timed).
mkdir -p /tmp/site
# Installed once per set of wheels (a stamp lists them): parts of a run that start side by
# side (run_eval_parts.sh) must not reinstall into /tmp/site while another part imports. The
# serve and grpc extras with smg (.whl-serve/, about 35 MB with smg's wheel stripped and
# xz-compressed, see run_grpc_gateway_h200.sh) travel only to the calls that start `lmpool
# serve` hosts.
mkdir -p /tmp/xz-wheels
for f in .whl-serve/*.whl.xz; do
  [ -f "$f" ] && [ ! -f "/tmp/xz-wheels/$(basename "${f%.xz}")" ] && python3 -c \
    'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$f" "/tmp/xz-wheels/$(basename "${f%.xz}")"
done
wheels=$(ls .whl/*.whl .whl-serve/*.whl 2>/dev/null; compgen -G ".whl-serve/*.whl.xz" >/dev/null && ls /tmp/xz-wheels/*.whl)
if [ -n "$wheels" ] && [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $wheels && echo "$wheels" >/tmp/site/.wheels
fi
# NVIDIA Dynamo's router for the dynamo_kv peer, when .whl-dynamo/ travels (made here by
# benchmarks/device/pack_dynamo.py: its wheel xz-compressed with a stripped library, and its needs
# as wheels for this Python); none of it when the folder is absent. Once per set, as above.
if compgen -G ".whl-dynamo/*.whl.xz" >/dev/null && [ "$(cat /tmp/site/.dynamo 2>/dev/null)" != "$(ls .whl-dynamo/)" ]; then
  mkdir -p /tmp/dynamo-wheel
  for f in .whl-dynamo/*.whl.xz; do
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$f" "/tmp/dynamo-wheel/$(basename "${f%.xz}")"
  done
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl-dynamo/*.whl /tmp/dynamo-wheel/*.whl \
    && ls .whl-dynamo/ >/tmp/site/.dynamo
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
