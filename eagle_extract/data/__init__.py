"""The data side: data sources and row formats to records, records to token ids and loss masks, the token store."""
