# One image for every fedrl service: the patch store, the SuperLink (+ ServerApp), SuperNodes
# and the one-shot run submitter. The base is a build argument: a normal slim Python image
# for users; deploy/compose-test.sh builds on a Debian base made with debootstrap (no image
# registry is reachable where fedrl is developed).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# a constraints file from the build context (e.g. constraints.txt) pins exact builds; empty: the ranges
ARG PIP_CONSTRAINTS=""
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FEDRL_CACHE=/var/lib/fedrl/cache

WORKDIR /opt/fedrl
# dependencies first, in a layer of their own: a change to fedrl's code does not reinstall torch
COPY .wheels/ /tmp/wheels/
COPY pyproject.toml constraints.txt ./
RUN python3 -m venv /opt/venv \
 && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
 && pip install --no-cache-dir --find-links /tmp/wheels ${PIP_CONSTRAINTS:+-c $PIP_CONSTRAINTS} -r /tmp/requirements.txt \
 && rm -rf /tmp/wheels /tmp/requirements.txt
COPY README.md ./
COPY fedrl/ fedrl/
COPY strategies/ strategies/
COPY clients/ clients/
COPY sim/ sim/
COPY deploy/ deploy/
COPY cli/ cli/
COPY volunteer/ volunteer/
RUN pip install --no-cache-dir --no-deps . \
 && mkdir -p /var/lib/fedrl/cache /var/lib/fedrl/state /var/lib/fedrl/run \
 && fedrl prepare --model tiny-base

WORKDIR /var/lib/fedrl
CMD ["fedrl", "--help"]
