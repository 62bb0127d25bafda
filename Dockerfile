# CPU image for every role (the GPU images with vLLM / DeepSpeed come with the production-engines work).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY rolloutpipe ./rolloutpipe
COPY configs ./configs
RUN pip install --no-cache-dir .
ENTRYPOINT ["rolloutpipe"]
