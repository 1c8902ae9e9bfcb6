#!/usr/bin/env bash
# Creates the two databases of the alignflow stack, each owned by its own role:
#   prefect  (Prefect server: flow runs, deployments, work pools)
#   mlflow   (MLflow tracking + model registry; artifacts live in S3, not here)
# Run once by the postgres image on first start (mounted under /docker-entrypoint-initdb.d);
# a volume that already holds a cluster skips it. Passwords come from the environment
# (infra/.env), passed to psql as variables so no value is spliced into the SQL text.
set -euo pipefail

: "${PREFECT_DB_PASSWORD:?PREFECT_DB_PASSWORD is not set: put it in infra/.env (see infra/.env.example)}"
: "${MLFLOW_DB_PASSWORD:?MLFLOW_DB_PASSWORD is not set: put it in infra/.env (see infra/.env.example)}"

create_database() {
  local name="$1" password="$2"
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
       -v name="$name" -v password="$password" <<'SQL'
CREATE ROLE :"name" LOGIN PASSWORD :'password';
CREATE DATABASE :"name" OWNER :"name";
REVOKE ALL ON DATABASE :"name" FROM PUBLIC;
SQL
}

create_database prefect "$PREFECT_DB_PASSWORD"
create_database mlflow "$MLFLOW_DB_PASSWORD"
