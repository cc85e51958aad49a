#!/bin/sh
# First start of deploy/compose.yaml's postgres volume (docker-entrypoint-initdb.d): one database and one user for
# Dagster, one for MLflow, as deploy/postgres.sh makes them. Passwords from the environment (letters and digits).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres <<SQL
CREATE ROLE dagster LOGIN PASSWORD '$DAGSTER_DB_PASSWORD';
CREATE ROLE mlflow LOGIN PASSWORD '$MLFLOW_DB_PASSWORD';
CREATE DATABASE dagster OWNER dagster;
CREATE DATABASE mlflow OWNER mlflow;
REVOKE CONNECT ON DATABASE dagster FROM PUBLIC;
REVOKE CONNECT ON DATABASE mlflow FROM PUBLIC;
SQL
