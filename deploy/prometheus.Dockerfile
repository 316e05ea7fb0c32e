# The compose stack's optional Prometheus: Debian's package on the same base as fedrl's image
# (no image registry needed), configured by deploy/prometheus.sh from the stack's environment.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/fedrl/prometheus
COPY deploy/prometheus.sh /usr/local/bin/fedrl-prometheus
CMD ["sh", "/usr/local/bin/fedrl-prometheus"]
