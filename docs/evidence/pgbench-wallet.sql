-- The wallet's transaction at one message per transaction, for pgbench: the database alone,
-- beside which `evidence bench --batches 1 --handlers message` is measured.
-- Set up once (psql): CREATE SCHEMA pgb; CREATE TABLE pgb.inbox (message_id text,
--   consumer_id int, processed_minute int, PRIMARY KEY (consumer_id, message_id));
--   CREATE TABLE pgb.accounts (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
--   CREATE TABLE pgb.ledger (id bigserial PRIMARY KEY, event_id text NOT NULL,
--   account_id bigint NOT NULL, amount bigint NOT NULL,
--   applied_at timestamptz NOT NULL DEFAULT clock_timestamp());
-- Run: pgbench -h 127.0.0.1 -U postgres -n -f docs/evidence/pgbench-wallet.sql -c 6 -j 2 -T 10
--   -M prepared inbox   (and -c 1 -j 1)
\set acc random(1, 100)
BEGIN;
INSERT INTO pgb.inbox (message_id, consumer_id, processed_minute) VALUES (gen_random_uuid()::text, 1, 0) ON CONFLICT DO NOTHING;
INSERT INTO pgb.accounts (id, balance) VALUES (:acc, 1) ON CONFLICT (id) DO UPDATE SET balance = pgb.accounts.balance + EXCLUDED.balance;
INSERT INTO pgb.ledger (event_id, account_id, amount) VALUES (gen_random_uuid()::text, :acc, 1);
COMMIT;
