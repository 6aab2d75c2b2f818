# syntax=docker/dockerfile:1
# A Functions host with dbtrigger as its custom handler.
#   docker build -t dbtrigger-app .
# Your pollers: one folder per function, each with its function.json (see function_templates/),
# copied under /home/site/wwwroot: replace the COPY of the webhook-poller template at the end with
# your own folders (the folder name is the function name).
#
# The build stage caches dependencies with BuildKit cache mounts (the cargo registry and the target
# directory persist between builds), so there are no stand-in sources to keep in step with
# Cargo.toml. scripts/replay-docker-build runs this stage's COPY and RUN lines without a container
# engine, in a clean directory, and CI runs it: the two cannot drift.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY function_templates ./function_templates
COPY benches ./benches
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin dbtrigger \
    && mkdir -p out \
    && cp target/release/dbtrigger out/dbtrigger \
    && strip out/dbtrigger

# The runtime: the Functions v4 host without a language worker, the base image Microsoft lists for
# custom handlers (docs/deploy-container.md, "Choose the base image"). The binary is run once here, so that a C library
# older than the build stage's fails `docker build` instead of the deployed app.
FROM mcr.microsoft.com/azure-functions/base:4
ENV AzureWebJobsScriptRoot=/home/site/wwwroot \
    AzureFunctionsJobHost__Logging__Console__IsEnabled=true \
    FUNCTIONS_WORKER_RUNTIME=custom
COPY host.json /home/site/wwwroot/host.json
COPY function_templates/webhook-poller /home/site/wwwroot/orders
COPY --from=build --chmod=0755 /src/out/dbtrigger /home/site/wwwroot/dbtrigger
RUN ["/home/site/wwwroot/dbtrigger", "--version"]
