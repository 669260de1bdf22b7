# Sourced by the scripts run on the lent GPU machine, with REPO set to the checkout:
# mps_exporter importable from it, and the wheels the image lacks (bcrypt, nvitop,
# nvitop-exporter, py-spy) installed from .whl/ (no pip index there).
mkdir -p /tmp/pkg && ln -sfn $REPO/exporter /tmp/pkg/mps_exporter
if ls $REPO/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $REPO/.whl/*.whl
fi
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
