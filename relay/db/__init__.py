"""The relay's database side: its statements (queries), the store that runs them (store) over
one asyncpg pool (pool), what their errors mean (errors), and the store's parts: the unordered
claim's lanes (claims), the ordered destinations' owners (owner) and what it read of their rows
(owned), the rows claimed as envelopes (envelopes), the pending gauges (gauges), retention
(retention), the start-up checks (checks); what the pipeline asks of any source of leased rows
(leasing); the settings of its sessions (session), and the reading of what holds back VACUUM
(snapshots)."""
