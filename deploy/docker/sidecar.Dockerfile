# The specpilot controller (sidecar) image. Build from the repository root (BuildKit, the default
# builder, reads sidecar.Dockerfile.dockerignore beside this file):
#   docker build -f deploy/docker/sidecar.Dockerfile -t specpilot:0.1.0 .
# The benchmarks and the simulator are not copied, so the wheel cannot contain them.

# --- build: a wheel and the controller's dependencies, with the build tools --------------------
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY controller ./controller
COPY engine_plugin ./engine_plugin
COPY proto ./proto
RUN pip install --no-cache-dir --prefix=/install .

# --- final: the interpreter, the installed packages, a non-root user; no compilers, no pip cache
FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
COPY --from=build /install /usr/local
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specpilot
USER 10001
EXPOSE 50051 9464
# Listening beyond loopback, it starts only with SPECPILOT_ENGINE_SECRET set (each engine sends its
# own token, `specpilot engine-token`) or SPECPILOT_ALLOW_UNAUTHENTICATED_ENGINES=true; the Helm
# chart sets the secret from a Secret and an init container derives the engine's token.
ENTRYPOINT ["specpilot"]
CMD ["serve", "--grpc-host", "0.0.0.0", "--http-host", "0.0.0.0"]
