# The Inference Fabric image: the project's own install (pyproject.toml), for the broker and
# for workers (deploy/kubernetes/, docs/scaling.md).
#
#   docker build -t inference-fabric:0.1.0 .
#   docker build -t inference-fabric:0.1.0-generate --build-arg EXTRAS=generate .
#
# EXTRAS names optional groups of pyproject.toml (`generate`: the transformers engine,
# `parquet`). The vllm engine needs vLLM on a CUDA base: build FROM this image and
# `pip install vllm` (docs/engines.md).
# The entrypoint is `tini -- fabric`: the command line of run.py (`fabric` is the install's
# console script). Give it a subcommand (`worker ...`) or `--config FILE` to serve.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Wheels of the project and every dependency; a C compiler for those published only as a
# source distribution.
FROM ${PYTHON_IMAGE} AS wheels
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
ARG EXTRAS=""
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".${EXTRAS:+[$EXTRAS]}"

FROM ${PYTHON_IMAGE}
# tini as PID 1: it hands SIGTERM to the broker's supervisor alone (which stops its stages in
# order, front first) or to a worker (which drains), and reaps orphaned processes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 fabric \
    && useradd --system --uid 10001 --gid fabric --home-dir /var/lib/fabric --create-home fabric
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-index /tmp/wheels/*.whl && rm -rf /tmp/wheels
# The checkout beside the install, as on a host (/opt/inference-fabric): the example configs,
# the minilm tokenizer a config names by path, the docs.
WORKDIR /opt/inference-fabric
COPY . .
ENV PYTHONUNBUFFERED=1
USER 10001:10001
ENTRYPOINT ["/usr/bin/tini", "--", "fabric"]
CMD ["--config", "/etc/fabric/config/fabric.toml"]
