//! This crate's errors, and how an SQS failure maps to what the consumer does next.

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use inbox_core::{BoxError, Recovery, SourceError};

/// What went wrong talking to SQS or setting up a source or sender.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The settings cannot work; the message says which one and how to fix it.
    #[error("invalid SQS configuration: {0}")]
    Config(String),
    /// An SQS API call failed.
    #[error("SQS {operation} on {queue_url} failed: {source}")]
    Sqs {
        /// The API operation, e.g. `ReceiveMessage`.
        operation: &'static str,
        /// The queue it was called on.
        queue_url: String,
        /// The service's error code, when it answered with one (`ReceiptHandleIsInvalid`, ...).
        code: Option<String>,
        /// What the consumer should do about it.
        recovery: Recovery,
        /// The SDK's error.
        #[source]
        source: BoxError,
    },
    /// Some entries of a batch call failed after every attempt.
    #[error("SQS {operation} on {queue_url}: {failed} of {total} entries failed, first: {first}")]
    Batch {
        /// The API operation, e.g. `SendMessageBatch`.
        operation: &'static str,
        /// The queue it was called on.
        queue_url: String,
        /// How many entries failed.
        failed: usize,
        /// How many entries were sent.
        total: usize,
        /// The first failure's code and message.
        first: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an SDK error from `operation` on `queue_url`, deciding whether retrying can help.
    pub(crate) fn sdk<E, R>(operation: &'static str, queue_url: &str, err: SdkError<E, R>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug + Send + Sync + 'static,
    {
        let recovery = recovery_of(&err);
        let code = err.code().map(str::to_owned);
        // `DisplayErrorContext` prints the whole chain: the service's code and message, or the
        // connection error under a dispatch failure, which `SdkError`'s own Display hides.
        let text = aws_sdk_sqs::error::DisplayErrorContext(&err).to_string();
        Error::Sqs {
            operation,
            queue_url: queue_url.to_owned(),
            code,
            recovery,
            source: text.into(),
        }
    }

    /// What the consumer should do about this error.
    pub fn recovery(&self) -> Recovery {
        match self {
            Error::Config(_) => Recovery::Fatal,
            Error::Sqs { recovery, .. } => *recovery,
            Error::Batch { .. } => Recovery::Retry,
        }
    }

    /// The receipt handle no longer names an in-flight copy of the message.
    pub(crate) fn is_stale_receipt(&self) -> bool {
        matches!(self, Error::Sqs { code: Some(code), .. } if STALE_RECEIPT_CODES.contains(&code.as_str()))
    }
}

impl From<Error> for SourceError {
    fn from(e: Error) -> Self {
        let recovery = e.recovery();
        let context = match &e {
            Error::Config(_) => "SQS source configuration",
            Error::Sqs { operation, .. } | Error::Batch { operation, .. } => operation,
        };
        SourceError::new(recovery, context, e)
    }
}

/// Error codes after which retrying the same call cannot help: the queue is gone, the
/// credentials or permissions are wrong, the request is malformed.
const FATAL_CODES: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "SignatureDoesNotMatch",
    "InvalidSecurity",
    "InvalidAddress",
    "MissingAuthenticationToken",
    "KmsAccessDenied",
    "KmsDisabled",
    "KmsNotFound",
    "InvalidAttributeName",
    "InvalidAttributeValue",
];

/// Error codes that say a receipt handle no longer names an in-flight copy: the message was
/// deleted, or handed out again under a newer handle.
const STALE_RECEIPT_CODES: &[&str] = &[
    "ReceiptHandleIsInvalid",
    "InvalidParameterValue",
    "MessageNotInflight",
    "AWS.SimpleQueueService.MessageNotInflight",
];

fn recovery_of<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> Recovery {
    match err {
        SdkError::ConstructionFailure(_) => Recovery::Fatal,
        SdkError::DispatchFailure(_) => Recovery::Reconnect,
        SdkError::TimeoutError(_) | SdkError::ResponseError(_) => Recovery::Retry,
        _ => match err.code() {
            Some(code) if FATAL_CODES.contains(&code) => Recovery::Fatal,
            _ => Recovery::Retry,
        },
    }
}
