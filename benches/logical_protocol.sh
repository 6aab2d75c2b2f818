#!/bin/bash
# Peek (SQL interface) against START_REPLICATION (pg_recvlogical) on the same changes, PostgreSQL 15.
# Run as root on a machine with PostgreSQL 15 installed (it starts its own server as the postgres user,
# on a free port, in /tmp/m5/pg): bash benches/logical_protocol.sh. Cited by docs/logical-performance.md.
set -e
B=/usr/lib/postgresql/15/bin
D=/tmp/m5/pg; rm -rf $D; mkdir -p $D; chown postgres $D
PORT=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
su postgres -c "$B/initdb -D $D/data -U postgres -A trust --no-sync -E UTF8" >/dev/null
su postgres -c "$B/pg_ctl -D $D/data -o '-p $PORT -k $D -c listen_addresses=127.0.0.1 -c wal_level=logical -c fsync=off -c max_wal_size=4GB' -l $D/log start -w" >/dev/null
P="psql -X -q -h 127.0.0.1 -p $PORT -U postgres -d postgres -v ON_ERROR_STOP=1"
trap "su postgres -c '$B/pg_ctl -D $D/data stop -m fast' >/dev/null" EXIT
now() { date +%s.%N; }
run() { # $1 label, $2 workload sql
  $P -c "SET client_min_messages = warning; DROP TABLE IF EXISTS orders; DROP PUBLICATION IF EXISTS feed; CREATE TABLE orders (id BIGINT PRIMARY KEY, status TEXT, total NUMERIC(12,2), at TIMESTAMPTZ); CREATE PUBLICATION feed FOR TABLE orders;"
  for s in peek1 peek2 repl; do $P -c "SELECT pg_create_logical_replication_slot('$s', 'pgoutput')" >/dev/null; done
  $P <<< "$2"
  END=$($P -At -c "SELECT pg_current_wal_flush_lsn()")
  ROWS=$($P -At -c "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('peek2', NULL, NULL, 'proto_version','1','publication_names','feed')")
  t0=$(now); $P -c "\\copy (SELECT lsn, data FROM pg_logical_slot_peek_binary_changes('peek1', NULL, NULL, 'proto_version','1','publication_names','feed')) to /dev/null with (format binary)"; t1=$(now)
  $P -c "\\copy (SELECT lsn, data FROM pg_logical_slot_peek_binary_changes('peek1', NULL, NULL, 'proto_version','1','publication_names','feed')) to /dev/null with (format binary)"; t2=$(now)
  $B/pg_recvlogical -h 127.0.0.1 -p $PORT -U postgres -d postgres -S repl --start --endpos=$END --no-loop -o proto_version=1 -o publication_names=feed -f /dev/null; t3=$(now)
  echo "$1: $ROWS pgoutput rows; peek $(echo "$t1 - $t0" | bc) s, peek again $(echo "$t2 - $t1" | bc) s, START_REPLICATION $(echo "$t3 - $t2" | bc) s"
  for s in peek1 peek2 repl; do $P -c "SELECT pg_drop_replication_slot('$s')" >/dev/null; done
}
for i in 1 2 3; do
run "50k in transactions of 10" "DO \$\$ BEGIN FOR i IN 0..2856 LOOP INSERT INTO orders SELECT g, 'new', g * 1.5, now() FROM generate_series(i * 10 + 1, i * 10 + 10) g; COMMIT; END LOOP; END \$\$; DO \$\$ BEGIN FOR i IN 0..1427 LOOP UPDATE orders SET status = 'paid' WHERE id BETWEEN i * 10 + 1 AND i * 10 + 10; COMMIT; END LOOP; END \$\$; DO \$\$ BEGIN FOR i IN 0..713 LOOP DELETE FROM orders WHERE id BETWEEN i * 10 + 1 AND i * 10 + 10; COMMIT; END LOOP; END \$\$;"
run "one transaction of 500k inserts" "INSERT INTO orders SELECT g, 'new', g * 1.5, now() FROM generate_series(1, 500000) g;"
done
