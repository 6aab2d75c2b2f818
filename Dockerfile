# syntax=docker/dockerfile:1
# Build: docker build -t dbtrigger-app .
# The image is a Functions host (the .NET in-process image, as Core Tools' custom-handler template
# uses) with the dbtrigger binary and the function folders at /home/site/wwwroot.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so that source changes do not rebuild them.
COPY Cargo.toml Cargo.lock ./
# (Cargo checks that every declared target exists, so the benchmark gets a stand-in too.)
RUN mkdir -p src benches && echo 'fn main() {}' > src/main.rs && echo '' > src/lib.rs \
    && echo 'fn main() {}' > benches/seek.rs \
    && cargo build --release --locked --bin dbtrigger \
    && rm -rf src
COPY src ./src
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin dbtrigger && strip target/release/dbtrigger

FROM mcr.microsoft.com/azure-functions/dotnet:4
ENV AzureWebJobsScriptRoot=/home/site/wwwroot \
    AzureFunctionsJobHost__Logging__Console__IsEnabled=true
COPY host.json /home/site/wwwroot/host.json
# Your pollers: one folder per function, each with its function.json (see function_templates/).
COPY function_templates/webhook-poller /home/site/wwwroot/orders
COPY --from=build --chmod=0755 /src/target/release/dbtrigger /home/site/wwwroot/dbtrigger
