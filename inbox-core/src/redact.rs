//! Keeping secrets out of `Debug` output, logs and error messages.

/// What a secret is shown as.
pub const REDACTED: &str = "***";

/// `url` with its password, and the value of any query parameter whose name contains
/// `password` or `secret`, replaced by `***`: `amqp://guest:***@host/%2f`,
/// `postgres://app:***@db/app?sslmode=require`. The user name, host and path stay, so the
/// address can still be told apart.
///
/// Made for logs, not for parsing: it errs on the side of hiding. The user information ends at
/// the last `@`, so a password with an `@`, `/` or `?` in it (which should be percent-encoded)
/// is hidden whole; an `@` in the path or query hides what comes before it.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, after)) => {
            let user = match userinfo.split_once(':') {
                Some((user, _password)) => format!("{user}:{REDACTED}"),
                None => userinfo.to_owned(),
            };
            format!("{scheme}://{user}@{}", redact_query(after))
        }
        None => format!("{scheme}://{}", redact_query(rest)),
    }
}

/// Whether a setting named `name` holds a secret: its name contains `password` or `secret`
/// (any case), or it is a private key (`ssl.key.pem`) or a SASL OAuth configuration.
pub fn is_secret_setting(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name.contains("password")
        || name.contains("secret")
        || name.ends_with("key.pem")
        || name == "sasl.oauthbearer.config"
}

/// `host/path?query` with the secret query parameters hidden.
fn redact_query(url: &str) -> String {
    let Some((before, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_setting(name) => format!("{name}={REDACTED}"),
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{before}?{query}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_leave_urls_and_the_rest_stays() {
        for (url, shown) in [
            (
                "amqp://guest:s3cret@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
            (
                "postgres://app:p@ss:w/rd@db:5432/app?sslmode=require&password=s3cret",
                "postgres://app:***@db:5432/app?sslmode=require&password=***",
            ),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("postgres://app@db/app", "postgres://app@db/app"),
            ("amqp://u:pa?ss@host/v", "amqp://u:***@host/v"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn secret_settings_are_recognised_by_name() {
        for name in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
            "Some_SECRET",
        ] {
            assert!(is_secret_setting(name), "{name}");
        }
        for name in ["sasl.username", "bootstrap.servers", "ssl.certificate.pem"] {
            assert!(!is_secret_setting(name), "{name}");
        }
    }
}
