# vLLM with the specpilot engine plugin. Build from the repository root (BuildKit, the default
# builder, reads vllm.Dockerfile.dockerignore beside this file):
#   docker build -f deploy/docker/vllm.Dockerfile -t vllm-specpilot:0.1.0 .
# The base is vLLM's own OpenAI-server image (GPU); the plugin is pure Python and registers
# through the vllm.general_plugins entry point. The image receives the plugin and the contract it
# imports (specpilot.contract beside the generated protobuf code, under proto/), and the
# controller package the one wheel also holds (the plugin imports none of it); never the
# benchmarks or the simulator: they are not copied, so the wheel cannot contain them.

FROM vllm/vllm-openai:v0.33.0 AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY controller ./controller
COPY engine_plugin ./engine_plugin
COPY proto ./proto
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM vllm/vllm-openai:v0.33.0
COPY --from=build /wheels /wheels
# Without extras: vLLM and torch come with the base (the wheel does not depend on them); its
# own dependencies (grpcio, protobuf, numpy, ...) are wheels, nothing compiles.
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin vllm
USER 10001
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
