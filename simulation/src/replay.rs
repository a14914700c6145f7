//! The dead letters read back and replayed to their source by the real
//! [`inbox_core::replay::replay`], through a reader and a publisher on the simulated broker.

use std::sync::Arc;

use inbox_core::replay::{self, DeadLetter, DeadLetters, Selection};
use inbox_core::{MessageId, OperationError, OutgoingMessage, Publish, PublishError, Recovery};

use crate::brokers::sqs;
use crate::world::{world, Published, Shared};

/// One parked message: where it sits among the dead letters (a new place each time a message
/// is parked), the entry it was read from, and its ID.
#[derive(Debug, Clone)]
pub(crate) struct Letter {
    pub(crate) position: String,
    pub(crate) entry: usize,
    pub(crate) id: String,
}

/// Reads the world's dead letters in order; removing takes them out.
struct Reader {
    world: Shared,
    next: usize,
}

fn failed(what: &str) -> OperationError {
    OperationError::new(Recovery::Retry, what, "the simulation failed it")
}

impl DeadLetters for Reader {
    fn name(&self) -> &str {
        "dead letters"
    }

    async fn next(&mut self, max: usize) -> Result<Vec<DeadLetter>, OperationError> {
        let mut w = world(&self.world);
        if w.core.fault(0.05) {
            w.core.note("reading the dead letters fails".into());
            return Err(failed("reading dead letters"));
        }
        let letters: Vec<DeadLetter> = w
            .core
            .letters
            .iter()
            .skip(self.next)
            .take(max)
            .map(|l| {
                let mut letter = DeadLetter::new(l.position.clone(), Vec::new());
                letter.id = Some(MessageId::new(l.id.clone()).unwrap());
                letter.original_source = Some("source".into());
                letter.key = Some(format!("entry {}", l.entry));
                // As the SQS reader does; only the simulated SQS FIFO reads it.
                letter.headers.push(sqs::replay_header(&l.position));
                letter
            })
            .collect();
        self.next += letters.len();
        Ok(letters)
    }

    async fn remove(&mut self, letters: &[DeadLetter]) -> Result<(), OperationError> {
        let mut w = world(&self.world);
        if w.core.fault(0.05) {
            w.core.note("removing replayed dead letters fails".into());
            return Err(failed("removing dead letters"));
        }
        for letter in letters {
            let at = w
                .core
                .letters
                .iter()
                .position(|l| l.position == letter.position)
                .unwrap();
            w.core.letters.remove(at);
            self.next -= 1;
        }
        Ok(())
    }
}

/// Publishes each copy as a new entry of the broker, in its original's lane.
struct Publisher {
    world: Shared,
}

impl Publish for Publisher {
    async fn send_batch(
        &self,
        _destination: &str,
        messages: &[OutgoingMessage],
    ) -> Result<(), PublishError> {
        let mut w = world(&self.world);
        let w = &mut *w;
        for message in messages {
            let original: usize = message
                .key
                .as_deref()
                .and_then(|k| k.strip_prefix("entry "))
                .and_then(|i| i.parse().ok())
                .unwrap();
            let lane = w.core.entries[original].lane;
            let i = w.core.entries.len();
            w.core.entries.push(Published {
                id: message.id.to_string(),
                lane,
                replayed: message
                    .headers
                    .iter()
                    .any(|(name, _)| name == inbox_core::REPLAYED),
            });
            let kept = w.broker.send(&mut w.core, i, message);
            w.core.note(format!(
                "replayed {} as entry {i}{}",
                message.id,
                if kept {
                    ""
                } else {
                    ": dropped by the broker's deduplication"
                }
            ));
        }
        Ok(())
    }
}

/// Replays every dead letter once, as an operator would after fixing the downstream.
pub(crate) async fn replay_all(shared: &Shared) {
    let mut reader = Reader {
        world: Arc::clone(shared),
        next: 0,
    };
    let publisher = Publisher {
        world: Arc::clone(shared),
    };
    let result = replay::replay(
        &mut reader,
        &publisher,
        &Selection::all(),
        false,
        &mut |_| {},
    )
    .await;
    let line = match result {
        Ok(report) => format!("replay moved {} dead letters", report.moved),
        Err(e) => format!("replay stopped: {e}"),
    };
    world(shared).core.note(line);
}
