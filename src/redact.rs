//! Secrets never reach a message or a log line. Connection URLs (PostgreSQL,
//! AMQP) may carry a password; this is the one place they lose it.

/// The password between `user:` and `@`, if the URL has one.
pub fn password_of(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.rsplit_once('@')?.0;
    Some(userinfo.split_once(':')?.1).filter(|p| !p.is_empty())
}

/// A URL with its password replaced by `***`, for messages.
pub fn redact_url(url: &str) -> String {
    if !url.contains("://") {
        return "(unparsable URL)".to_string();
    }
    redact_in(url, url)
}

/// A URL with its whole user part (`user:password@`, or a token alone,
/// `token@`) replaced by `***@`: for URLs whose user part may itself be
/// the secret (an OTLP collector's).
pub fn redact_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(unparsable URL)".to_string();
    };
    let end = rest.find('/').unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_string(),
    }
}

/// `text` with every occurrence of `url`'s password replaced by `***`.
pub fn redact_in(text: &str, url: &str) -> String {
    match password_of(url) {
        Some(password) => text.replace(password, "***"),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_messages_lose_the_password() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@10.0.0.1:5672/%2f"),
            "amqp://guest:***@10.0.0.1:5672/%2f"
        );
        assert_eq!(redact_url("amqp://127.0.0.1"), "amqp://127.0.0.1");
        assert_eq!(redact_url("not a url"), "(unparsable URL)");
        let url = "postgres://app:hunter2@db/x";
        assert_eq!(
            redact_in("bad port in postgres://app:hunter2@db", url),
            "bad port in postgres://app:***@db"
        );
    }
}
