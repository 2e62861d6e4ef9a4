//! Cutting a shard's log in the raft-engine store: a suffix truncation (a
//! follower dropping records its leader never committed, or a repair) and a
//! prefix compaction (retention).

use super::*;

impl EngineStore {
    /// [`LogStore::truncate_suffix`]: the chunk holding `keep_through + 1`
    /// rewritten as its prefix (or replaced by a tombstone when the cut
    /// falls between chunks), every later chunk's directory key and every
    /// producer snapshot past the cut deleted, in one synced batch.
    pub(super) fn cut_suffix(&self, shard: ShardId, keep_through: u64) -> StoreResult<()> {
        let _writer = self.write_lock.lock();
        let bounds = self.state(shard)?;
        check_truncate(shard, bounds, keep_through)?;
        if keep_through >= bounds.last_seqno {
            return Ok(());
        }
        let (cut, cut_first, next) = {
            let shards = self.shards.lock();
            let chunks = &shards.get(&shard).expect("checked").chunks;
            let cut = chunks.find(keep_through + 1).expect("a retained seqno is in a chunk");
            (cut, chunks.get(cut).expect("found").first_seqno, chunks.next_index())
        };
        let group = region(shard);
        let mut batch = LogBatch::default();
        let prefix_from = cut_first.max(bounds.first_seqno);
        let plan = if prefix_from <= keep_through {
            // The cut chunk keeps its records up to `keep_through`.
            let prefix = match self.fetch_chunk(shard, cut) {
                Ok(bytes) => Segment::frames_in(&bytes, prefix_from, keep_through, usize::MAX)
                    .map(|(_, frames)| frames)
                    .map_err(|e| {
                        self.find_damage(shard, cut, StoreError::Io(format!("shard {shard}: chunk {cut}: {e}")))
                    })?,
                // The chunk is damaged after the cut (a repair): its intact
                // records before the cut are kept.
                Err(e) => self.read_damaged(shard, cut, prefix_from, keep_through, io(e))?,
            };
            let prefix: Vec<&Frame> = prefix.iter().collect();
            let (written, _) =
                self.add_chunks(&mut batch, shard, cut, split(Vec::new(), prefix_from, &prefix, usize::MAX), false)?;
            for index in cut + 1..next {
                batch.delete(group, chunk::key(index));
            }
            Plan { shard, write_from: cut, written, seal_old_tail: false, tail_after: None }
        } else {
            // The cut falls between chunks: a tombstone replaces the first
            // chunk removed, and with it every later one, without reading
            // any record (those before the cut may be damaged: this is
            // how a damaged range is repaired).
            let tombstone = ChunkMeta::tombstone(keep_through + 1);
            batch
                .add_entries::<ChunkEntry>(
                    group,
                    &[Entry { index: cut, data: bytes::Bytes::new(), ..Entry::default() }],
                )
                .map_err(io)?;
            batch.put(group, chunk::key(cut), tombstone.encode()).map_err(io)?;
            for index in cut + 1..next {
                batch.delete(group, chunk::key(index));
            }
            Plan { shard, write_from: cut, written: vec![tombstone], seal_old_tail: false, tail_after: None }
        };
        for (seqno, _) in self.snapshot_keys(shard)? {
            if seqno > keep_through {
                batch.delete(group, producers_key(seqno));
            }
        }
        self.write(&mut batch, true)?;
        let mut shards = self.shards.lock();
        let state = shards.get_mut(&shard).expect("checked");
        self.apply(state, plan);
        state.bounds.last_seqno = keep_through;
        state.bounds.durable_seqno = state.bounds.durable_seqno.min(keep_through);
        Ok(())
    }

    /// [`LogStore::compact_prefix`]: `walship/first` raised, the whole
    /// chunks before the one holding `first_kept` compacted away with their
    /// keys and the producer snapshots they no longer need, in one synced
    /// batch; then the log files no shard needs are purged.
    pub(super) fn cut_prefix(&self, shard: ShardId, first_kept: u64) -> StoreResult<()> {
        let _writer = self.write_lock.lock();
        let bounds = self.state(shard)?;
        check_compact(shard, bounds, first_kept)?;
        if first_kept <= bounds.first_seqno {
            return Ok(());
        }
        let group = region(shard);
        let (keep_from, first_index, next) = {
            let shards = self.shards.lock();
            let chunks = &shards.get(&shard).expect("checked").chunks;
            (chunks.find(first_kept).unwrap_or(chunks.next_index()), chunks.first_index(), chunks.next_index())
        };
        let mut batch = LogBatch::default();
        put_u64(&mut batch, group, FIRST_KEY, first_kept)?;
        for (seqno, _) in self.snapshot_keys(shard)? {
            if seqno + 1 < first_kept {
                batch.delete(group, producers_key(seqno));
            }
        }
        if keep_from > first_index && first_index < next {
            batch.add_command(group, Command::Compact { index: keep_from });
            for index in first_index..keep_from {
                batch.delete(group, chunk::key(index));
            }
            if keep_from == next {
                put_u64(&mut batch, group, NEXT_CHUNK_KEY, next)?;
            }
        }
        self.write(&mut batch, true)?;
        {
            let mut shards = self.shards.lock();
            let state = shards.get_mut(&shard).expect("checked");
            state.chunks.compact_to(keep_from);
            self.tail_frames.set(state, None);
            state.bounds.first_seqno = first_kept;
        }
        // Drop whole log files no shard needs any more.
        self.engine.purge_expired_files().map_err(io)?;
        Ok(())
    }
}
