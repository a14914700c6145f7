//! Dead letters read back and replayed to where they came from, written once for every broker.
//!
//! An adapter implements [`DeadLetters`]: read its dead-letter destination in order, and remove
//! what was replayed. Everything else is here: [`summarize`] (count, per reason, oldest and
//! newest), [`find`] (one by its position) and [`replay`] (a [`Selection`] published back to each
//! message's [`original_source`](crate::dead_letter::ORIGINAL_SOURCE) through any [`Publish`](crate::Publish)).
//!
//! A replay never loses a message: each batch is published and confirmed first, and only then
//! removed from the dead-letter destination. A crash between the two leaves the message in both
//! places; a later replay publishes it again under the same ID and the inbox skips the copy. A
//! replayed message that the inbox had already applied (applied, then dead-lettered by a later
//! copy) is skipped the same way: replay is safe to repeat.
//!
//! ```
//! # use inbox_core::replay::{DeadLetter, Selection};
//! # use std::time::{Duration, UNIX_EPOCH};
//! let selection = Selection::all().reason("downstream down").since(UNIX_EPOCH);
//! let mut letter = DeadLetter::new("1-0", b"[1, 100]".to_vec());
//! letter.reason = Some("downstream down".into());
//! letter.timestamp = Some(UNIX_EPOCH + Duration::from_secs(60));
//! assert!(selection.matches(&letter));
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::SystemTime;

use futures_util::future::BoxFuture;

use crate::{dead_letter, DynPublish, MessageId, OperationError, OutgoingMessage};

/// How many dead letters a replay reads, publishes and removes at a time.
pub const BATCH: usize = 100;

/// One parked message read back from a dead-letter destination: the original message (ID,
/// payload, key, headers without the dead-letter metadata) and the metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Where it is in the dead-letter destination, as [`find`] takes it: a stream entry ID,
    /// `partition 0 offset 17`, an SQS message ID, the RabbitMQ message's place in the queue.
    pub position: String,
    /// The adapter's own handle to remove it with (a receipt handle, a delivery tag).
    pub handle: String,
    /// The message ID the inbox deduplicates on; `None` when it had none (such a message cannot
    /// be replayed, and stays).
    pub id: Option<MessageId>,
    /// The body, byte for byte.
    pub payload: Vec<u8>,
    /// The ordering key (a Kafka record key, an SQS FIFO group), where the broker has one.
    pub key: Option<String>,
    /// The original headers, without the ID and the dead-letter metadata.
    pub headers: Vec<(String, Vec<u8>)>,
    /// [`dead_letter::REASON`].
    pub reason: Option<String>,
    /// [`dead_letter::ORIGINAL_SOURCE`]: where a replay publishes it.
    pub original_source: Option<String>,
    /// [`dead_letter::ORIGINAL_POSITION`].
    pub original_position: Option<String>,
    /// When it was parked, where the broker says (the dead-letter record's or entry's time);
    /// RabbitMQ has only the message's own `timestamp` property, if it was set.
    pub timestamp: Option<SystemTime>,
}

impl DeadLetter {
    /// A dead letter at `position` (also its handle) with this payload and nothing else.
    pub fn new(position: impl Into<String>, payload: Vec<u8>) -> Self {
        let position = position.into();
        Self {
            handle: position.clone(),
            position,
            id: None,
            payload,
            key: None,
            headers: Vec::new(),
            reason: None,
            original_source: None,
            original_position: None,
            timestamp: None,
        }
    }

    /// Takes the dead-letter metadata out of `headers` (the broker's headers, attributes or
    /// fields, ID already removed) into their fields; every other header stays, in order.
    /// Values that are not UTF-8 are read lossily.
    pub fn take_metadata(&mut self, headers: Vec<(String, Vec<u8>)>) {
        for (name, value) in headers {
            let text = || String::from_utf8_lossy(&value).into_owned();
            match name.as_str() {
                dead_letter::REASON if self.reason.is_none() => self.reason = Some(text()),
                dead_letter::ORIGINAL_SOURCE if self.original_source.is_none() => {
                    self.original_source = Some(text());
                }
                dead_letter::ORIGINAL_POSITION if self.original_position.is_none() => {
                    self.original_position = Some(text());
                }
                _ => self.headers.push((name, value)),
            }
        }
    }

    /// Why this one cannot be replayed: no ID, or no source to go back to.
    pub fn unreplayable(&self) -> Option<&'static str> {
        if self.id.is_none() {
            Some("it has no message ID")
        } else if self.original_source.as_deref().is_none_or(str::is_empty) {
            Some("it names no original source")
        } else {
            None
        }
    }

    /// The message a replay publishes: same ID, payload, key and headers, marked
    /// [`REPLAYED`](crate::REPLAYED).
    fn outgoing(&self) -> Option<OutgoingMessage> {
        let mut message = OutgoingMessage::new(self.id.clone()?, self.payload.clone());
        message.key = self.key.clone();
        message.headers = self
            .headers
            .iter()
            .filter(|(name, _)| name != crate::REPLAYED)
            .cloned()
            .chain([(crate::REPLAYED.to_owned(), b"true".to_vec())])
            .collect();
        Some(message)
    }
}

/// A dead-letter destination, read in order: what each adapter implements. The algorithm
/// ([`summarize`], [`find`], [`replay`]) is written once on top.
///
/// A reader goes through the destination once, from its oldest message; what it has read and
/// not removed stays where it was (returned to the queue at [`DeadLetters::close`] where the
/// broker held it for the reader).
///
/// The algorithm takes readers as [`DynDeadLetters`] objects, which every `DeadLetters` is.
pub trait DeadLetters: Send {
    /// The name of the dead-letter destination, for the output.
    fn name(&self) -> &str;

    /// The next dead letters, at most `max`, oldest first; empty once none is left that this
    /// reader has not returned.
    fn next(
        &mut self,
        max: usize,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, OperationError>> + Send;

    /// Removes these dead letters (returned by [`DeadLetters::next`] of this reader) from the
    /// destination. Called only after their copies were published and confirmed.
    fn remove(
        &mut self,
        letters: &[DeadLetter],
    ) -> impl Future<Output = Result<(), OperationError>> + Send;

    /// Ends the reading: what was read and not removed is left, or put back, where it was.
    fn close(&mut self) -> impl Future<Output = Result<(), OperationError>> + Send {
        async { Ok(()) }
    }
}

/// [`DeadLetters`] as a trait object: what [`summarize`], [`scan`], [`find`] and [`replay`]
/// take, and what a tool that opens readers of different brokers keeps
/// (`Box<dyn DynDeadLetters>`). Made as [`DynPublish`] is, for the same reason: every
/// `DeadLetters` implements it, and `dyn DynDeadLetters` implements `DeadLetters`.
pub trait DynDeadLetters: Send {
    /// [`DeadLetters::name`].
    fn dyn_name(&self) -> &str;

    /// [`DeadLetters::next`].
    fn dyn_next(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<DeadLetter>, OperationError>>;

    /// [`DeadLetters::remove`].
    fn dyn_remove<'a>(
        &'a mut self,
        letters: &'a [DeadLetter],
    ) -> BoxFuture<'a, Result<(), OperationError>>;

    /// [`DeadLetters::close`].
    fn dyn_close(&mut self) -> BoxFuture<'_, Result<(), OperationError>>;
}

impl<D: DeadLetters> DynDeadLetters for D {
    fn dyn_name(&self) -> &str {
        DeadLetters::name(self)
    }
    fn dyn_next(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<DeadLetter>, OperationError>> {
        Box::pin(DeadLetters::next(self, max))
    }
    fn dyn_remove<'a>(
        &'a mut self,
        letters: &'a [DeadLetter],
    ) -> BoxFuture<'a, Result<(), OperationError>> {
        Box::pin(DeadLetters::remove(self, letters))
    }
    fn dyn_close(&mut self) -> BoxFuture<'_, Result<(), OperationError>> {
        Box::pin(DeadLetters::close(self))
    }
}

impl DeadLetters for dyn DynDeadLetters + '_ {
    fn name(&self) -> &str {
        self.dyn_name()
    }
    async fn next(&mut self, max: usize) -> Result<Vec<DeadLetter>, OperationError> {
        self.dyn_next(max).await
    }
    async fn remove(&mut self, letters: &[DeadLetter]) -> Result<(), OperationError> {
        self.dyn_remove(letters).await
    }
    async fn close(&mut self) -> Result<(), OperationError> {
        self.dyn_close().await
    }
}

/// Which dead letters to replay: all by default, narrowed by reason and by time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    reason: Option<String>,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
}

impl Selection {
    /// Every dead letter.
    pub fn all() -> Self {
        Self::default()
    }

    /// Only those parked with exactly this reason.
    #[must_use]
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// Only those parked at or after `time` (one without a time does not match).
    #[must_use]
    pub fn since(mut self, time: SystemTime) -> Self {
        self.since = Some(time);
        self
    }

    /// Only those parked before `time` (one without a time does not match).
    #[must_use]
    pub fn until(mut self, time: SystemTime) -> Self {
        self.until = Some(time);
        self
    }

    /// Whether `letter` is selected.
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        if let Some(reason) = &self.reason {
            if letter.reason.as_ref() != Some(reason) {
                return false;
            }
        }
        if self.since.is_none() && self.until.is_none() {
            return true;
        }
        let Some(time) = letter.timestamp else {
            return false;
        };
        self.since.is_none_or(|since| time >= since) && self.until.is_none_or(|until| time < until)
    }
}

/// Count, oldest and newest of a group of dead letters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tally {
    /// How many.
    pub count: u64,
    /// The earliest time among them (those with a time).
    pub oldest: Option<SystemTime>,
    /// The latest time among them.
    pub newest: Option<SystemTime>,
}

impl Tally {
    fn add(&mut self, letter: &DeadLetter) {
        self.count += 1;
        if let Some(time) = letter.timestamp {
            self.oldest = Some(self.oldest.map_or(time, |t| t.min(time)));
            self.newest = Some(self.newest.map_or(time, |t| t.max(time)));
        }
    }
}

/// What a dead-letter destination holds: in all, and per reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Summary {
    /// Every dead letter.
    pub total: Tally,
    /// Per reason (`None`: no reason recorded), sorted by reason.
    pub by_reason: BTreeMap<Option<String>, Tally>,
}

impl Summary {
    /// Counts one more dead letter.
    pub fn add(&mut self, letter: &DeadLetter) {
        self.total.add(letter);
        self.by_reason
            .entry(letter.reason.clone())
            .or_default()
            .add(letter);
    }
}

/// Reads the whole destination and counts it, leaving everything where it was.
pub async fn summarize(letters: &mut dyn DynDeadLetters) -> Result<Summary, OperationError> {
    let mut summary = Summary::default();
    scan(letters, &mut |letter| summary.add(letter)).await?;
    Ok(summary)
}

/// Hands every dead letter to `each`, oldest first, leaving everything where it was.
pub async fn scan(
    letters: &mut dyn DynDeadLetters,
    each: &mut (dyn FnMut(&DeadLetter) + Send),
) -> Result<(), OperationError> {
    let read = async {
        loop {
            let batch = letters.dyn_next(BATCH).await?;
            if batch.is_empty() {
                return Ok(());
            }
            batch.iter().for_each(&mut *each);
        }
    }
    .await;
    finish(letters, read).await
}

/// The dead letter at `position` (as [`DeadLetter::position`] says it), or else the first one
/// whose message ID is `position`, leaving everything where it was.
pub async fn find(
    letters: &mut dyn DynDeadLetters,
    position: &str,
) -> Result<Option<DeadLetter>, OperationError> {
    let found = async {
        loop {
            let batch = letters.dyn_next(BATCH).await?;
            if batch.is_empty() {
                return Ok(None);
            }
            if let Some(letter) = batch.into_iter().find(|l| {
                l.position == position || l.id.as_ref().is_some_and(|id| id.as_str() == position)
            }) {
                return Ok(Some(letter));
            }
        }
    }
    .await;
    finish(letters, found).await
}

/// How far a [`replay`] got.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Dead letters read.
    pub read: u64,
    /// Of those, the ones the selection chose.
    pub selected: u64,
    /// Published back to their source and removed from the dead-letter destination (with
    /// `dry_run`: would have been).
    pub moved: u64,
    /// Selected, but left where they are: no ID, or no original source.
    pub unreplayable: u64,
    /// Of the moved, letters of an ID this replay had already published to the same source:
    /// removed without another copy (one copy per ID is all the inbox applies; more would only
    /// be skipped, or each be given its own budget of attempts by the effect consumer).
    pub duplicates: u64,
    /// Moved, per original source.
    pub by_source: BTreeMap<String, u64>,
}

/// Publishes the selected dead letters back to their original source through `publisher`, a
/// batch at a time (up to [`BATCH`], grouped per source), and removes each batch from the
/// dead-letter destination once the publisher confirmed it. With `dry_run` nothing is published
/// or removed; the report counts what would move. `progress` is called after each batch.
///
/// The copies keep their ID, payload, key and headers (without the dead-letter metadata), so
/// the inbox skips any it has applied before, and carry [`REPLAYED`](crate::REPLAYED). One copy
/// per ID and source: further letters of an ID already published in this replay are removed
/// without a copy ([`ReplayReport::duplicates`]). A failure stops the replay: what was
/// confirmed is removed, the rest stays for the next attempt, and any copy published but not
/// yet removed is published again then, under the same ID, and skipped by the inbox.
pub async fn replay(
    letters: &mut dyn DynDeadLetters,
    publisher: &dyn DynPublish,
    selection: &Selection,
    dry_run: bool,
    progress: &mut (dyn FnMut(&ReplayReport) + Send),
) -> Result<ReplayReport, OperationError> {
    let mut report = ReplayReport::default();
    let mut published: BTreeSet<(String, MessageId)> = BTreeSet::new();
    let moved = async {
        loop {
            let batch = letters.dyn_next(BATCH).await?;
            if batch.is_empty() {
                return Ok(());
            }
            report.read += batch.len() as u64;
            let mut by_source: BTreeMap<String, Vec<DeadLetter>> = BTreeMap::new();
            for letter in batch.into_iter().filter(|l| selection.matches(l)) {
                report.selected += 1;
                if letter.unreplayable().is_some() {
                    report.unreplayable += 1;
                    continue;
                }
                let source = letter.original_source.clone().unwrap_or_default();
                by_source.entry(source).or_default().push(letter);
            }
            for (source, chosen) in by_source {
                let firsts: Vec<&DeadLetter> = chosen
                    .iter()
                    .filter(|l| {
                        l.id.clone()
                            .is_some_and(|id| published.insert((source.clone(), id)))
                    })
                    .collect();
                report.duplicates += (chosen.len() - firsts.len()) as u64;
                if !dry_run {
                    let messages: Vec<OutgoingMessage> = firsts
                        .into_iter()
                        .filter_map(DeadLetter::outgoing)
                        .collect();
                    publisher.dyn_send_batch(&source, &messages).await?;
                    letters.dyn_remove(&chosen).await?;
                }
                let n = chosen.len() as u64;
                report.moved += n;
                *report.by_source.entry(source).or_default() += n;
            }
            progress(&report);
        }
    }
    .await;
    finish(letters, moved).await?;
    Ok(report)
}

/// Closes the reader whatever happened, and reports the first failure.
async fn finish<T>(
    letters: &mut dyn DynDeadLetters,
    result: Result<T, OperationError>,
) -> Result<T, OperationError> {
    let closed = letters.dyn_close().await;
    let value = result?;
    closed?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::{Publish, Recovery};

    /// A dead-letter destination in memory: a list, and what was removed.
    struct Parked {
        letters: Vec<DeadLetter>,
        read: usize,
        removed: Vec<String>,
        closed: bool,
    }

    impl DeadLetters for Parked {
        fn name(&self) -> &str {
            "parked"
        }
        async fn next(&mut self, max: usize) -> Result<Vec<DeadLetter>, OperationError> {
            let end = (self.read + max).min(self.letters.len());
            let batch = self.letters[self.read..end].to_vec();
            self.read = end;
            Ok(batch)
        }
        async fn remove(&mut self, letters: &[DeadLetter]) -> Result<(), OperationError> {
            self.removed
                .extend(letters.iter().map(|l| l.handle.clone()));
            Ok(())
        }
        async fn close(&mut self) -> Result<(), OperationError> {
            self.closed = true;
            Ok(())
        }
    }

    #[derive(Default)]
    struct Sent(Mutex<Vec<(String, OutgoingMessage)>>, Option<&'static str>);

    impl Publish for Sent {
        async fn send_batch(
            &self,
            destination: &str,
            messages: &[OutgoingMessage],
        ) -> Result<(), OperationError> {
            if self.1 == Some(destination) {
                return Err(OperationError::new(Recovery::Retry, "sending", "refused"));
            }
            let mut sent = self.0.lock().unwrap();
            sent.extend(messages.iter().map(|m| (destination.to_owned(), m.clone())));
            Ok(())
        }
    }

    fn letter(n: u64, reason: &str, source: &str) -> DeadLetter {
        let mut l = DeadLetter::new(format!("{n}-0"), format!("[{n}]").into_bytes());
        l.id = Some(MessageId::new(format!("id-{n}")).unwrap());
        l.take_metadata(vec![
            ("tenant".into(), b"acme".to_vec()),
            (dead_letter::REASON.into(), reason.as_bytes().to_vec()),
            (
                dead_letter::ORIGINAL_SOURCE.into(),
                source.as_bytes().to_vec(),
            ),
            (
                dead_letter::ORIGINAL_POSITION.into(),
                format!("{n}").into_bytes(),
            ),
        ]);
        l.timestamp = Some(UNIX_EPOCH + Duration::from_secs(n));
        l
    }

    fn parked(letters: Vec<DeadLetter>) -> Parked {
        Parked {
            letters,
            read: 0,
            removed: Vec::new(),
            closed: false,
        }
    }

    #[tokio::test]
    async fn a_summary_counts_per_reason_with_the_oldest_and_newest() {
        let mut dlq = parked(
            (1..=250)
                .map(|n| letter(n, if n % 2 == 0 { "even" } else { "odd" }, "a"))
                .collect(),
        );
        let summary = summarize(&mut dlq).await.unwrap();
        assert_eq!(summary.total.count, 250);
        assert_eq!(
            summary.total.oldest,
            Some(UNIX_EPOCH + Duration::from_secs(1))
        );
        assert_eq!(
            summary.total.newest,
            Some(UNIX_EPOCH + Duration::from_secs(250))
        );
        let even = &summary.by_reason[&Some("even".to_owned())];
        assert_eq!(even.count, 125);
        assert_eq!(even.oldest, Some(UNIX_EPOCH + Duration::from_secs(2)));
        assert!(dlq.closed && dlq.removed.is_empty());

        let mut dlq = parked((1..=250).map(|n| letter(n, "x", "a")).collect());
        let found = find(&mut dlq, "201-0").await.unwrap().unwrap();
        assert_eq!(found.payload, b"[201]");
        assert_eq!(found.headers, [("tenant".to_owned(), b"acme".to_vec())]);
        assert!(find(&mut parked(vec![]), "1-0").await.unwrap().is_none());
        let mut dlq = parked((1..=3).map(|n| letter(n, "x", "a")).collect());
        let by_id = find(&mut dlq, "id-3").await.unwrap().unwrap();
        assert_eq!(by_id.position, "3-0");
        let mut dlq = parked((1..=250).map(|n| letter(n, "x", "a")).collect());
        let mut seen = Vec::new();
        scan(&mut dlq, &mut |l| seen.push(l.position.clone()))
            .await
            .unwrap();
        assert_eq!((seen.len(), seen[249].as_str()), (250, "250-0"));
        assert!(dlq.closed && dlq.removed.is_empty());
    }

    #[tokio::test]
    async fn a_replay_publishes_the_selection_to_each_source_then_removes_it() {
        let mut letters: Vec<DeadLetter> = (1..=150)
            .map(|n| {
                letter(
                    n,
                    if n <= 120 { "down" } else { "bad" },
                    if n % 2 == 0 { "a" } else { "b" },
                )
            })
            .collect();
        letters[0].id = None;
        // A letter of a message replayed before.
        letters[1]
            .headers
            .push((crate::REPLAYED.into(), b"true".to_vec()));
        let mut dlq = parked(letters);
        let sent = Sent::default();
        let selection = Selection::all()
            .reason("down")
            .until(UNIX_EPOCH + Duration::from_secs(101));
        let mut calls = 0;
        let report = replay(&mut dlq, &sent, &selection, false, &mut |_| calls += 1)
            .await
            .unwrap();
        assert_eq!((report.read, report.selected), (150, 100));
        assert_eq!((report.moved, report.unreplayable), (99, 1));
        assert_eq!(report.by_source["a"], 50);
        assert_eq!(calls, 2);
        assert_eq!(dlq.removed.len(), 99);
        assert!(!dlq.removed.contains(&"1-0".to_owned()));
        let sent = sent.0.into_inner().unwrap();
        assert_eq!(sent.len(), 99);
        let (source, first) = &sent[0];
        assert_eq!(source, "a");
        assert_eq!(first.id.as_str(), "id-2");
        assert_eq!(
            first.headers,
            [
                ("tenant".to_owned(), b"acme".to_vec()),
                (crate::REPLAYED.to_owned(), b"true".to_vec())
            ],
            "the original headers, and the mark of a replay once"
        );
    }

    #[tokio::test]
    async fn a_replay_publishes_one_copy_of_an_id_and_removes_its_other_letters() {
        let mut letters: Vec<DeadLetter> = (1..=4).map(|n| letter(n, "down", "a")).collect();
        letters[2].id = letters[0].id.clone();
        letters[3].id = letters[0].id.clone();
        letters[3].original_source = Some("b".into());
        let mut dlq = parked(letters);
        let sent = Sent::default();
        let report = replay(&mut dlq, &sent, &Selection::all(), false, &mut |_| {})
            .await
            .unwrap();
        assert_eq!((report.moved, report.duplicates), (4, 1));
        assert_eq!(
            dlq.removed.len(),
            4,
            "the duplicate's letter is removed too"
        );
        let sent: Vec<(String, String)> = sent
            .0
            .into_inner()
            .unwrap()
            .into_iter()
            .map(|(source, m)| (source, m.id.to_string()))
            .collect();
        assert_eq!(
            sent,
            [("a", "id-1"), ("a", "id-2"), ("b", "id-1")].map(|(s, i)| (s.into(), i.into())),
            "one copy of id-1 per source"
        );
    }

    #[tokio::test]
    async fn a_dry_run_moves_nothing_and_a_failed_publish_removes_nothing_of_its_batch() {
        let mut dlq = parked((1..=10).map(|n| letter(n, "down", "a")).collect());
        let sent = Sent::default();
        let report = replay(&mut dlq, &sent, &Selection::all(), true, &mut |_| {})
            .await
            .unwrap();
        assert_eq!(report.moved, 10);
        assert!(dlq.removed.is_empty() && sent.0.lock().unwrap().is_empty());

        let mut dlq = parked((1..=10).map(|n| letter(n, "down", "a")).collect());
        let refusing = Sent(Mutex::default(), Some("a"));
        let e = replay(&mut dlq, &refusing, &Selection::all(), false, &mut |_| {})
            .await
            .unwrap_err();
        assert_eq!(e.recovery(), Recovery::Retry);
        assert!(dlq.removed.is_empty() && dlq.closed);
    }

    #[test]
    fn readers_and_the_replay_future_are_send() {
        fn assert_send<T: Send>(_: &T) {}
        let mut dlq = parked(vec![]);
        let sent = Sent::default();
        let selection = Selection::all();
        assert_send(&replay(&mut dlq, &sent, &selection, true, &mut |_| {}));
        let boxed: Box<dyn DynDeadLetters> = Box::new(parked(vec![]));
        assert_send(&boxed);
    }

    #[test]
    fn a_time_range_needs_a_time() {
        let mut l = letter(5, "r", "a");
        assert!(Selection::all()
            .since(UNIX_EPOCH + Duration::from_secs(5))
            .matches(&l));
        assert!(!Selection::all()
            .until(UNIX_EPOCH + Duration::from_secs(5))
            .matches(&l));
        l.timestamp = None;
        assert!(Selection::all().matches(&l));
        assert!(!Selection::all().since(UNIX_EPOCH).matches(&l));
    }
}
